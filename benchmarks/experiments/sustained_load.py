"""Does a decode step slow down under load, and what slows it (issue 33: the Qwen3.5 step's % of the roofline)? A bare
decode chain runs 2.49-2.51 ms a step in a fresh process; after the process's first greedy generation on the device
loop it runs ~2.70, about what every generation's token costs, for as long as the process lives.

--phases, in order (comma-separated); after each, the GPU's SM and memory clocks, power, temperature and throttle
reasons (`nvidia-smi`):
- "roofline": the XLA read roofline (`jspec_bench.roofline._xla_sum_Bps`, 2 GiB).
- "chain:S[:LABEL]": S seconds of the decode chain LABEL of `device_loop_profile.chain_walls` (the Engine's prepared
  weights; "1", one step a while-loop iteration, unless named; "1-nographs" launches every kernel from the host) in
  back-to-back windows of --window-s, each with the clocks sampled after it.
- "rest:S": S idle seconds.
- "warm": the greedy on-device generation compiled and run once (n tokens, then 1); "generate:R": R timed
  generations (ms a token over --new-tokens minus 1; warms first); "hostgen:T": one host-loop generation of T
  tokens (T = 1: the prefill and the first token); "drafted:DRAFTER[:nested]": one on-device generation with a
  drafter (mtp, lookup) on the Engine, its rounds' loop as shipped or nested (`phase_drafted`);
  "gentime:PART[:MODE[:R[:prof]]]": a whole generation's executable (generate_on_device or unchecked, below) timed
  as "generate" times the Engine's (`phase_gentime`); "split" the prefill's executable and the rounds', MODE
  "PREFILL_MODE/ROUNDS_MODE" compiling each with its own options; with ":prof", then its GPU kernels per token,
  profiled (`device_loop_profile.token_kernels`).
- "devexec:MODE": the Engine's on-device generation executable, "compile" only, "run" once, or "get" (run, copy back).
- "genpart:PART[:MODE[:RUNS]]": a part of the generation (`jspec.loop`) as its own executable, compiled with a
  MODE's options (`EXECUTABLE_MODES`) and run RUNS times (default: as shipped, once; `generation_part_once`):
  "start", "first", "rounds" (decode rounds without prefill), "prefill_round", "prefill_rounds" (both, no request
  check), "generate_on_device" (the whole, jitted here, not by the Engine), "unchecked" (it without the request
  check's cond).
- "prefill:MODE": `jspec.steps.prefill` as its own executable: "compile" only, or run "shipped", "host_while" (no
  WHILE / CONDITIONAL graphs), "no_graphs", "no_blas_graphs" (cuBLAS / cuBLASLt calls outside the graphs).
- "otherchain:LABEL": another chain (`chain_walls` labels: 1-nested, 1-internal) compiled and run.
- "stack:B": the context's stack per GPU thread set to B bytes (`cuCtxSetLimit`); "pending:N": its device runtime's
  pending-launch limit set to N launches (`CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT`); "cacheconfig:C": its cache
  configuration set to C (`cuCtxSetCacheConfig`); every phase records the context's limits, cache and shared-memory
  configurations, flags and free memory (`context_sample`).
- "attn": one prefill chunk's attention kernel (a static start); "dqgemm": a 128-row product with each int4 weight
  shape; "gdn[:MODE]": the chunked recurrence (`chunk_gated_delta`) over a 128-position chunk at the model's linear
  heads, compiled with a MODE's options, or one part of it alone: "trsm" (its triangular solve), "einsum" /
  "einsum_default" (its float32 q k^T products, HIGHEST / default precision), "scan" (its chunk loop's state
  updates), "cumexp" (its decays), "parts" (those four, one executable each, one after another); "kernels:N": N
  small executables of one elementwise kernel each (N distinct kernels loaded); "torchgraph:N": a torch CUDA graph
  of N tiny kernels captured, instantiated and replayed once in the same CUDA context (`torch_graph_once`: many
  graph nodes alive, none of them XLA's); "gemm[:MODE]": a bf16 dot;
  "stepprof": the decode step's kernels, profiled (`device_loop_profile.step_profiler`); "stepstate:STATE[:prof]": the
  bare chain (and, with ":prof", the step's kernels) on a state made as STATE says (prefilled, start, random, zeros,
  a mix: `step_state`), to tell a real prefill's data from the process; "d2h:WHAT": arrays made on
  the device copied to the host (`phase_d2h`); "alloc:G": G GiB allocated and freed.
- --engine-mode MODE: the Engine's executables (the timed generations, the chains) compiled with EXECUTABLE_MODES[MODE]
  instead of the shipped options, to time a mode where a user meets it.
- --xla-log LOG: the process's stderr (2> LOG), with TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3
  (without the first, jax 0.11 logs none of them): every phase's XLA command-buffer log lines counted into the
  JSON (`command_buffer_events`; a marker line on stderr opens each phase).
- A phase that compiles its own executables (genpart, prefill, attn, dqgemm, gdn, gemm, kernels) destroys them after it;
  "+KIND:ARG" keeps them alive until a "drop", which destroys them and every executable the Engine holds
  (`phase_drop`). The run of 6627ec2 named "+genpart:PART" "held:PART".

Runs (experiments/results/, Qwen3.5 text shape unless named, 320-token prompts; each call a fresh machine start):
- sustained_load_qwen35_h200.json (b721c5b, the default phases): the chain 2.49-2.51 ms a step through a minute of
  load, clocks at 1980 / 3201 MHz, ~510 W, no throttle reason; the roofline 4.223 TB/s cold, 4.218 hot: no drift.
- sustained_load_generate_{qwen35,llama}_h200.json (c09458f, two processes in one call): the chain 2.493-2.497 ms,
  the generations 2.63-2.68 ms a token, the chain after them 2.682-2.690; Llama-3-8B (the second process, fast again
  at its start) 2.372 -> generations 2.48-2.53 -> 2.550. Clocks 1980 / 3201 MHz throughout, no throttle reason.
- sustained_load_trigger1..5_qwen35_h200.json (15a17bb, 35f3661, 908dd00, 84de6e5, 749229a): the chain stays at
  2.49-2.55 ms after allocating 40 GiB, a profiled decode step, a bf16 dot, a prefill chunk's attention and int4
  products, the prefill as its own executable (compiled only, no graphs, host-driven loops, as shipped), two other
  chains, and compiling the generation's executable; it runs 2.68-2.72 after the first run of the Engine's generation
  executable (before any copy back), after a host-loop generation of one token, and after a 30 s rest. The decode
  step's kernels, profiled per call, are unchanged by it (2659 -> 2656 us).
- sustained_load_genpart_qwen35_h200.json (46f6e18): nor do the generation's parts, each its own executable run once
  (start_loop; start_loop + first_round; start_loop + 65 decode rounds; prefill_round): the chain 2.49-2.53 ms
  throughout.
- sustained_load_stack_qwen35_h200.json, sustained_load_eager_qwen35_h200.json (d07dd53): the context's limits never
  move (the stack 1024 bytes a thread in every phase; setting it changes nothing); with CUDA_MODULE_LOADING=EAGER the
  modules load at the compile (520 MB of device memory) and the chain stays 2.52-2.54 after it; the first run of the
  Engine's generation executable enters the state in both (2.69-2.70), while `prefill_rounds` and the generation
  jitted here (an identical program: its StableHLO differs only in the module's name), each run once and destroyed,
  do not (2.51-2.54).
- sustained_load_held_qwen35_h200.json, sustained_load_drop_qwen35_h200.json (6627ec2): destroying the Engine's
  executables ("drop") leaves the state (2.47-2.54); the generation jitted here enters it when held alive (2.70-2.72),
  as does `prefill_round` held (2.72-2.97); `start_loop` held, and it with 65 rounds, do not (2.50-2.57). A
  generation's token costs 2.65-2.72 ms whichever process state came before it.
- sustained_load_heldkernels (fa38d48), _blas, _platform_alloc, _sticky (ccd139e), _gdn_{einsum,einsum_default,scan,
  cumexp} (66d0f1c) _qwen35_h200.json: one run of the chunked recurrence ("gdn": `chunk_gated_delta` over one
  128-position chunk, the prefill's chunk) enters the state, held or destroyed at once, with graphs or without them,
  with the platform allocator (XLA_PYTHON_CLIENT_ALLOCATOR=platform) too; after it, neither "drop", 40 GiB allocated,
  nor a rest leaves it (the platform run's later generation and drop did: 2.47-2.54). Its parts alone do not: its
  float32 products (HIGHEST: one cuBLASLt matmul; default), its triangular solve (cuBLAS trsm), its chunk loop, its
  decays; nor a held prefill attention kernel, the held prefill int4 products, a held bf16 dot; nor (trigger runs)
  the prefill, which runs it in each of its chunks, destroyed after one run. Not the context's limits, not module
  loading, not the allocator, not the graphs: some kernel sequences enter the state and some later events leave it.
- sustained_load_nographs_qwen35_h200.json (335fde9): the chain launched from the host ("1-nographs") slows too, less
  than the shipped chain: 2.71-2.80 -> 2.75-2.76 ms a step after "gdn", the shipped chain 2.50-2.52 -> 2.71. The
  context's cache configuration is 0 (no preference) in every phase, and setting it to 2 (L1), 1 (shared) or back
  to 0 moves nothing (2.71 in each).
- sustained_load_connections1_qwen35_h200.json, sustained_load_connections32_qwen35_h200.json (f36798a; the meta's
  env holds CUDA_DEVICE_MAX_CONNECTIONS = 1, 32): with one hardware work queue or 32 the same: the chain 2.49-2.51
  -> 2.68 (1) and 2.51 -> 2.71-2.72 (32) after "gdn", the host-launched chain 2.71-2.80 -> 2.84-2.98, a generation
  2.67 ms a token. Not the cache preference, not the queues: the state costs the shipped chain 0.17-0.21 ms a step
  and the host-launched one 0.04-0.18, its mechanism still unknown. The per-call profiles of trigger1 ("stepprof")
  show where: the step's kernels keep their durations while the stream's idle time between them grows from 52 us a
  step to 230-935 us in the state; XLA runs command buffers thunk by thunk while a profiler is on, so the host's
  launches fall behind the GPU there.
- sustained_load_gaps_qwen35_h200.json (0db58eb, chain:1,stepprof,gdn,chain:1,stepprof): the same around one run of
  the recurrence: kernels 2654.8 -> 2655.8 us a step, the idle between them 53 -> 1493 us, the chain 2.50 -> 2.73-2.77.
- sustained_load_xla_log_qwen35_h200.json and its .log, XLA's command-buffer log (180296b, chain:1,gdn,chain:1):
  not a command buffer rebuilt on every call. The chain's (3 commands: its while loop) is recorded once before the
  recurrence and runs 12 calls without an update (2.52 ms a step); the recurrence's executable evicts it as its own
  6 are built; the next chain call runs a warm-up iteration and records the same 3 commands again (7.5 ms; the
  first time 8.0), and every later call runs it without an update, at 2.71 ms a step.
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=2 python3 \
        benchmarks/experiments/sustained_load.py --window-s 0.5 --phases chain:1,gdn,chain:1 --xla-log $OUT/xla.log \
        --commit SHA --out ... 2> $OUT/xla.log
- sustained_load_*_llama_h100.json and sustained_load_cublas_{qwen35,llama}_h100.json (d1f41a4, 1853494, 6c27c44; on
  an H100, the cuBLAS-heuristic options; one fresh process a file, its phases in its meta; --window-s 0.5): the chain
  2.71-2.75 ms a step fresh, 2.89-2.95 in the state. The state comes with the whole generation's executable's CUDA
  graphs (recorded at its second run): devexec_runs (run, run, get: 2.75 -> 2.77 -> 2.95 -> 2.94), devexec (compile,
  run, get: the get is its second run), whole_graphs (generate_on_device twice: 2.75 -> 2.94), warm_drop (the drop
  leaves it here: 2.89). Not: d2h, devexec_get (a first run copied back: 2.76), whole_nographs, whole_host_while (the
  same executable without graphs, or without WHILE / CONDITIONAL ones, run three times), rounds_graphs,
  prefill_round_graphs, prefill_rounds_graphs (the parts with their graphs, three runs), nested, held_prefill,
  held_prefill_nographs, kernels300, parts_once, rounds_hostgen, and the chunked recurrence (cublas_qwen35: 2.88-2.90
  before and after "gdn", 3.10 after a generation). A generation's token costs 2.82-2.88 ms whether the chain ran
  before it or not (gen_first1/2, chain_first1/2). Drawn in ../plots/process_state_graphs_h100.png.
- sustained_load_gentime_{unchecked,cbmodes,parts}_qwen35_h100.json (1949890, 1949890, 6454891; an H100, the
  Qwen3.5 text shape; each gentime executable destroyed after its phase, so the chain stays 2.92-2.94 ms a step
  throughout): a whole generation's token 3.12-3.14 ms with the request check's cond and without it ("unchecked":
  the same): not the cond. Under the command buffers' other node orders: SERIALIZE the same, CONCURRENT 3.08-3.09
  against 3.12-3.13 (-1.3%, one run). The parts: "steps" (the bare chain's body after start_loop) 2.890-2.899 ms a
  token and "rounds" (decode rounds, their bookkeeping included) 2.899-2.907; with the prefill in the same
  executable, "prefill_steps" 3.116-3.140 and "prefill_rounds" 3.120-3.141, the whole generation 3.127-3.129. So a
  round's bookkeeping costs nothing and the decode loop costs ~0.22 ms a token (7.6%) more in an executable that
  also prefills.
- sustained_load_split{,_reversed}_{llama,qwen35}_h100.json (c73f439; an H100; the Engine's on-device generation
  split into the prefill's executable and the rounds'; phases chain:1,gentime:generate_on_device,generate:3,
  gentime:split,generate:3,chain:1 and, reversed, chain:1,gentime:split,generate:3,gentime:generate_on_device,
  generate:3,chain:1; "generate" is the split Engine of that commit): Llama-3-8B shape, the Engine's token
  2.69-2.75 ms and the split's 2.71-2.73 against the one executable's 2.83-2.88 and the chain's 2.70-2.74 (`jspec
  bench`'s end-to-end greedy does not reproduce it: ../results/bench_e2e_split_ab*_h100.json, so the Engine keeps
  one executable); Qwen3.5 text shape, the one executable 3.06-3.12, the split 3.07-3.08, the Engine 3.06-3.13, the
  chain 2.87 fresh and 3.07-3.10 after the generations: the decode loop after a real prefill, in its executable or
  not.
- sustained_load_rounds_split_qwen35_h100.json (09f1982; chain:1,gentime:rounds,gentime:split,gentime:rounds,
  chain:1): the rounds after start_loop 2.898-2.908 ms a token before and after the split's 3.11-3.14, the chain
  2.92 at both ends.
- sustained_load_stepstate_qwen35_h100.json (3abfba8, each stepstate with a profile) and
  sustained_load_stepstate_mix_qwen35_h100.json (62922f6; chain:1,stepstate:random,warm,generate:2,chain:1,
  stepstate:random,stepstate:random+prefill,stepstate:prefilled,stepstate:prefilled-{kv,ssm,conv,hidden,tokens},
  stepstate:random,chain:1): not the prefill's data. The chain on a real prefill's state 2.83-2.89 ms a step, on a
  random one 2.82-2.87; after the Engine's generation (3.09-3.11 a token) the chain and a random state 3.03-3.10;
  right after one run of a new prefill_round executable the random state 2.86 again, every mix 2.82-2.90, the
  chain 2.90. The step's kernels 3088-3127 us in 450 launches whatever the state.
- sustained_load_gentime_modes_{qwen35,llama}_h100.json (62922f6; chain:1,gentime:generate_on_device[:MODE] for
  shipped, no_blas_graphs, host_while, no_graphs, gentime:rounds,chain:1): Llama-3-8B shape, the generation's token
  2.839-2.849 ms shipped, 2.697-2.699 with cuBLAS calls outside the graphs (the chain 2.68-2.70, the rounds without
  prefill 2.65-2.67), 2.72-2.73 with host-driven loops, 2.95-3.08 without graphs; Qwen3.5 text shape 3.06-3.08,
  3.06-3.09, 3.09-3.12, 3.31-3.40 (the rounds 2.84-2.87, the chain 2.83-2.89). The Engine compiled without the
  cuBLAS graphs decodes no faster (autotune_cost.py's no_blas_graphs: 0.994x, 1.002x): like the split before it,
  what this script's executables show did not carry to the Engine's.
- residual_norm_ab_{rows,unfused,blocks}_qwen35_h200.json (b1bfe2b, 180296b, 65aa4be; chain:2,stepprof,generate:2,
  each a fresh process, the first two in one machine start, the old tree from `git archive`): a kernel of our own
  for the residual add and the RMSNorm after it (docs/performance.md; since reverted) against XLA's two fusions:
  the chain 2.52-2.54 / 2.51-2.52 / 2.58-2.59 ms a step, the step's kernels 2716 / 2669 / 2743 us in 389 / 451 /
  389 launches, a generation's token 2.689 / 2.670-2.694 / 2.703-2.733 ms.
- sustained_load_torchgraph{,_nodes,_live,_pending}_qwen35_h100.json (edbdc77, 2642620; an H100, each a fresh
  process, its phases in its meta): the state without XLA. A torch CUDA graph of 4000 tiny kernels leaves the chain
  at 2.76 ms a step, one of 40000 takes it to 2.95 (the Engine's generation after it 2.95 a token); 8000 nodes
  leave it at 2.76, a second graph of 8000 takes it to 2.96, and so it does with the first destroyed before the
  second is captured: the count is cumulative, not the live one, somewhere in 8000-16000 kernel nodes of a process's
  life, and destroying every graph leaves the process in the state. Raising the device runtime's pending-launch
  limit to 65536 first changes nothing. sustained_load_gentime_{generate_on_device_shipped,split_shipped_shipped,
  split_no_graphs_shipped}_3_qwen35_h100.json (edbdc77; chain:3,gentime:...,chain:3): each generation executable,
  destroyed after its phase, runs 2.93-2.96 ms a token (one executable; the split; the split with its prefill outside
  graphs) while the chain after it stays 2.77, so a generation's own excess over the chain is there with or without
  the process state.
- sustained_load_gentime_parts_fresh_qwen35_h100.json (3a9530f), sustained_load_gentime_splitrest_qwen35_h100.json,
  sustained_load_stepstate_fresh_qwen35_h100.json (d4a237d; an H100, each a fresh process): where the generation's
  ~7% goes, first in a process that stays fast (the chain 2.73-2.77 ms a step before and after). Decode steps
  started from `start_loop` (no prefill: position 0 up) run at the chain's speed, bare ("steps" 2.72-2.74 ms a
  token) or as rounds ("rounds" 2.72-2.74); after a real prefill of the 320-token prompt in the same executable they
  do not ("prefill_steps" 2.92-2.97, "prefill_rounds" 2.95-2.98). Not the prefill having just run: the split with the
  prefill awaited and 1 s of idle before the rounds ("splitrest") 2.94-2.96, the split without 2.95-2.97. Not the
  prefill's data: the bare chain's executable on the real prefill's state at position 320 runs 2.73-2.75 ms a step,
  on a random one 2.72-2.76. What is left between them: the executable (the generation's parts against the chain's)
  and the position the loop starts at, 0 against 320. Profiling the step then entered the process state (every run
  after it 2.89-2.98). sustained_load_gentime_steps_at_qwen35_h100.json (1397cdf) and
  sustained_load_gentime_splitcopy_qwen35_h100.json (51c61d9), fresh processes, the chain 2.76-2.78 throughout: not
  the position either: the bare steps from start_loop's Loop moved to the prompt's end (position 320, an empty
  cache, "steps_at") 2.73-2.74 ms a token, "steps" 2.72-2.73, "prefill_steps" 2.94-2.96; and hardly where the
  Loop's buffers lie: the split with the prefill's Loop copied into new buffers before the rounds ("splitcopy")
  2.91, the split 2.95. Left: the generation's executables on a real prefill's cache and recurrent state (the
  chain's executable on the same state is fast; the generation's on an empty cache too).
- sustained_load_gentime_{prof,prof_modes,cblog,held_prefill}_qwen35_h100.json (760db9e; an H100, fresh processes):
  the same kernels, slower graphs. "prefill_steps" and "steps_at" share their optimized HLO loop body; profiled per
  token with a host-driven loop of graphed bodies ("host_while") they run 2771 and 2753 us of kernels, 435 launches
  each, at 2.96 and 2.77 ms a token; with no command buffers ("no_graphs") 3.19 and 3.22: no excess. The shipped
  mode's device-side WHILE hides its kernels from the profiler (0 a token). steps_at beside a held prefill_round
  executable (graphs recorded) stays at 2.72-2.75. XLA's log: prefill_steps holds 81 command buffers (176
  host-driven), steps_at 1 (2); no command buffer is updated per iteration in either. (Their kernels_per_token
  are 760db9e's own count, each kernel name's [us, launches]; the phase now writes `token_kernels`' fields.)
- sustained_load_gentime_thunks_qwen35_h100.json and its two thunk sequences (c28e354; an H100, one fresh process,
  XLA_FLAGS=--xla_dump_to with the parts' module names, --xla-log): the decode loop's body is the same, node for node
  and edge for edge, in prefill_steps and steps_at (297 kernels, 137 Mosaic GPU calls and a copy in one serial chain);
  what differs is around it: steps_at is one command buffer, while prefill_steps drives its prefill's chunk loop from
  the host (a chunk: 39 command buffers, 48 cuBLAS triangular solves outside them, 24 dynamic-slice copy fusions run
  async on 4 more streams), in 81 command buffers with the decode loop in the last. Timed here (one repeat each):
  steps_at 2.74 ms a token, prefill_steps 2.92; host-driven 2.83 against 3.01 (the profile as in 760db9e's: 2773 us of
  kernels in 435 launches); and the rounds' executable of the split (one command buffer with its WHILE, no other
  stream) 2.85 on a Loop no prefill made ("splitempty"). The split on the prefill's Loop read 4.11 here: its two
  executables evicted each other's command buffers (165 recordings of 83 buffers in the phase), likely re-recorded
  within the timed calls; 2.91-2.97 before.
- sustained_load_gentime_dsf_qwen35_h100.json and the dsf_verify prefill_steps' thunk sequence (fc8e3fd; an H100, one
  fresh process, XLA_FLAGS=--xla_dump_to): with the prefill's dynamic-slice copies on the main stream ("dsf_verify":
  no async start; its chunk loop still host-driven, 149 command buffers) prefill_steps runs 2.73-2.77 ms a token and
  generate_on_device 2.77-2.78, against 2.94-2.95 and 2.92-2.96 as shipped (steps_at 2.74-2.75); "no_dsf" leaves the
  copies async and runs 2.94. The Engine compiled with the same option did not gain in autotune_cost.py's one
  process, beside the shipped engine (dsf_verify: 0.999x at Qwen3.5, 1.003x at Llama-3-8B; with 128-token chunks
  1.000x).
- sustained_load_engine_{async_copies,dsf_verify}_qwen35_h100.json (5ae19d2) and ..._engine_no_dsf_async_qwen35_h100
  .json (a9b115e; an H100, one fresh process each, --engine-mode MODE --window-s 0.5 --phases chain:1,generate:3,
  chain:1, XLA_FLAGS=--xla_dump_to): the Engine alone. With the copies async (5ae19d2's shipped options) the chain
  2.75-2.76 ms, the generations 2.93-2.96 ms a token, the chain after them 2.95-2.96; dsf_verify 2.75 / 2.76-2.78 /
  2.76-2.78; no_dsf_async (the async wrapper pass disabled) 2.75 / 2.75-2.76 / 2.76. The Engine's executable: 48
  async starts, none with either. Shipped since f4c1acc: no_dsf_async's options (now "shipped"; "async_dsf" the old).

    python3 benchmarks/experiments/sustained_load.py --commit SHA --out $OUT/sustained_load_h200.json
    P=chain:1,+genpart:generate_on_device:shipped:2,chain:1   # or :no_graphs:3, :host_while:3, unchecked:shipped:2
    python3 benchmarks/experiments/sustained_load.py --model llama-3-8b --window-s 0.5 --phases $P --out ...
    P=chain:1,chain:1:1-nographs,gdn,chain:1,chain:1:1-nographs,cacheconfig:2,chain:1,cacheconfig:1,chain:1,cacheconfig:0,chain:1
    python3 benchmarks/experiments/sustained_load.py --window-s 0.5 --phases $P --commit SHA --out ...
    CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/experiments/sustained_load.py --window-s 0.5 \
        --phases chain:1,chain:1:1-nographs,gdn,chain:1,chain:1:1-nographs --commit SHA --out ...
    cd benchmarks/experiments/results
    python3 ../sustained_load.py --plot ../../plots/process_state.png sustained_load_{generate,trigger,genpart}*.json
    python3 ../sustained_load.py --plot ../../plots/process_state_executables.png sustained_load_{stack,held,drop,\
        heldkernels,blas,platform_alloc,sticky,gdn_einsum,gdn_scan,gdn_cumexp}_qwen35_h200.json
    python3 ../sustained_load.py --plot ../../plots/process_state_launches.png \
        sustained_load_{nographs,connections1,connections32}_qwen35_h200.json
    python3 ../sustained_load.py --plot ../../plots/process_state_graphs_h100.png sustained_load_{devexec_runs,\
        gen_first1,chain_first1,whole_graphs,whole_nographs,whole_host_while,rounds_graphs,prefill_round_graphs,\
        prefill_rounds_graphs,nested}_llama_h100.json
    python3 ../sustained_load.py --plot ../../plots/process_state_data_h100.png sustained_load_{rounds_split,\
        stepstate,stepstate_mix,gentime_modes}_qwen35_h100.json sustained_load_gentime_modes_llama_h100.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import gc
import gzip
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/: device_loop_profile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_loop_profile import (  # noqa: E402
    DYNAMIC_SLICE_OPTIONS,
    VARIANTS,
    bare_step,
    chain_walls,
    generation_wall,
    step_profiler,
    token_kernels,
    without_command_buffers,
)
from xla_options import NO_GRAPHS  # noqa: E402

from jspec import engine as engine_module  # noqa: E402
from jspec import loop as loop_module  # noqa: E402
from jspec.config import ModelConfig  # noqa: E402
from jspec.drafters import MTPDrafter, PromptLookup  # noqa: E402
from jspec.engine import Engine, compiler_options  # noqa: E402
from jspec.loop import (  # noqa: E402
    LoopSettings,
    _generate,
    decode_round,
    first_round,
    generate_on_device,
    generation_rounds,
    prefill_round,
    run_rounds,
    start_loop,
)
from jspec.state import init_state  # noqa: E402
from jspec.steps import prefill  # noqa: E402
from jspec_bench.report import experiment_meta, gpu_sample, save_experiment  # noqa: E402
from jspec_bench.roofline import _xla_sum_Bps  # noqa: E402
from jspec_bench.shapes import copy_tree, model_config, random_int4_params, random_state  # noqa: E402
from pallas_kernels import ROW_TILE  # noqa: E402
from pallas_kernels.int4_ws import Int4Codes  # noqa: E402
from pallas_kernels.matmul import linear  # noqa: E402
from pallas_kernels.prefill_attention import chunk_attention  # noqa: E402
from pallas_kernels.recurrent import CHUNK, chunk_gated_delta  # noqa: E402

# The run of b721c5b (sustained_load_qwen35_h200.json): the read roofline cold, a minute of the chain, the roofline
# hot, a rest, the chain again.
PHASES = "roofline,chain:60,roofline,rest:20,chain:4"
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')  # in a compiled executable's HLO text
PHASE_MARK = "sustained_load phase: "  # written to stderr before each phase (`command_buffer_events`)
GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\] ")  # "I1204 18:00:00.123456  1234 file.cc:12] "
CHAIN_COLORS = {False: "tab:blue", True: "tab:green"}  # plot_runs: the shipped chain, the host-launched one


def one_line(e: BaseException) -> str:
    """An error as the JSON records a fact of the machine: its type and message, cut to 200 characters."""
    return f"{type(e).__name__}: {e}"[:200]


CU_LIMITS = ("stack", "printf_fifo", "malloc_heap", "dev_runtime_sync_depth", "dev_runtime_pending_launches",
             "max_l2_fetch_granularity", "persisting_l2_cache")  # CUlimit 0..6, in order  # fmt: skip


def _cuda_call(cuda, status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call}: CUresult {status}")


def on_primary_context(fn):
    """fn(libcuda) run with device 0's primary context (the one XLA runs on) current on this thread."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    _cuda_call(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    _cuda_call(cuda, cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        return fn(cuda)
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cuda.cuDevicePrimaryCtxRelease_v2(0)


def context_sample() -> dict:
    """The CUDA primary context's limits (`cuCtxGetLimit`; the driver grows the stack per thread when a kernel needs
    more local memory and never shrinks it back), its cache and shared-memory configurations, its flags and the free
    device memory, or the error."""

    def sample(cuda) -> dict:
        value, flags, free, total = ctypes.c_size_t(), ctypes.c_uint(), ctypes.c_size_t(), ctypes.c_size_t()
        out = {}
        for limit, name in enumerate(CU_LIMITS):  # a limit the driver does not support reads as its CUresult
            status = cuda.cuCtxGetLimit(ctypes.byref(value), limit)
            out[f"limit_{name}"] = value.value if status == 0 else f"CUresult {status}"
        configs = (("cache_config", cuda.cuCtxGetCacheConfig), ("shared_mem_config", cuda.cuCtxGetSharedMemConfig))
        for name, get in configs:
            config = ctypes.c_int()  # CUfunc_cache: 0 none, 1 prefer shared, 2 prefer L1, 3 equal
            status = get(ctypes.byref(config))
            out[name] = config.value if status == 0 else f"CUresult {status}"
        _cuda_call(cuda, cuda.cuCtxGetFlags(ctypes.byref(flags)), "cuCtxGetFlags")
        _cuda_call(cuda, cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return out | {"ctx_flags": flags.value, "free_bytes": free.value}

    try:
        return on_primary_context(sample)
    except Exception as e:  # a fact of the machine, not a failure of the run
        return {"ctx_error": one_line(e)}


def set_context(what: str, value: int) -> None:
    """On the primary context: what "stack", cuCtxSetLimit(CU_LIMIT_STACK_SIZE, value bytes) (waits for the
    device's work); "dev_runtime_pending_launches", that limit (launches); "cache", cuCtxSetCacheConfig(value)
    (CUfunc_cache, `context_sample`)."""

    def set_it(cuda) -> None:
        if what in CU_LIMITS:
            _cuda_call(cuda, cuda.cuCtxSetLimit(CU_LIMITS.index(what), ctypes.c_size_t(value)), "cuCtxSetLimit")
        else:
            _cuda_call(cuda, cuda.cuCtxSetCacheConfig(value), "cuCtxSetCacheConfig")

    on_primary_context(set_it)


def prefill_attention_once(cfg, context: int):
    """One prefill chunk's attention at cfg's heads: `chunk_attention`'s kernel on 128 query rows at `context` over the
    cache, with `context` a static start (its differentiable entry, the same `_kernel_call`; a prefill's start is
    traced)."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = jnp.ones((128, hq, d), jnp.bfloat16)
    kv = jnp.ones((context + 128, hkv, 2, d), jnp.bfloat16)
    run = jax.jit(functools.partial(chunk_attention, scale=d**-0.5)).lower(q, kv, context).compile(compiler_options())
    run(q, kv, context).block_until_ready()
    return run


EXECUTABLE_MODES = {  # MODE (prefill, gdn, gemm, genpart, gentime) -> the XLA options an executable compiles with
    "shipped": VARIANTS["shipped"],
    "compile": VARIANTS["shipped"],  # compiled, not run
    "host_while": VARIANTS["host_while"],  # no WHILE / CONDITIONAL command buffers: the host drives the loops
    "no_graphs": VARIANTS["shipped"] | NO_GRAPHS,
    "no_blas_graphs": without_command_buffers("CUBLAS", "CUBLASLT"),
    "no_custom_graphs": without_command_buffers("CUSTOM_CALL"),  # Pallas kernels launched from the host
    # traced commands (cuBLAS, custom calls) recorded into the parent graph, not as child graphs: an XLA option since
    # openxla/xla#46394 (jax 0.10.2's XLA has none; an older XLA refuses it by name at the compile)
    "inline_traced": VARIANTS["shipped"] | {"xla_gpu_command_buffer_inline_traced_commands": True},
    # the command buffers' node order: one serial chain of nodes, or concurrent regions (shipped: LHS, the latency
    # hiding scheduler's)
    "cb_serialize": VARIANTS["shipped"] | {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
    "cb_concurrent": VARIANTS["shipped"] | {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    # async_dsf, no_dsf, dsf_verify: the prefill's dynamic-slice copies (async in c28e354's thunks and with async_dsf
    # or no_dsf; none async as shipped since f4c1acc, nor with dsf_verify)
    **{mode: VARIANTS["shipped"] | extra for mode, extra in DYNAMIC_SLICE_OPTIONS.items()},
}


def prefill_once(params, cfg, prompt: np.ndarray, mode: str):
    """The prompt's prefill (`jspec.steps.prefill`, 128-position chunks) as its own executable, compiled with
    EXECUTABLE_MODES[mode], run once (mode "compile": not run) and returned."""
    state = init_state(cfg, prompt.size + 16, jnp.bfloat16)
    args = (params, state, jnp.asarray(prompt), jnp.asarray(prompt.size, jnp.int32))
    options = compiler_options() and EXECUTABLE_MODES[mode]
    run = jax.jit(lambda p, s, t, n: prefill(p, cfg, s, t, n, chunk=128)).lower(*args).compile(options)
    if mode != "compile":
        run(*args)[1].block_until_ready()
    return run


def device_exec_once(engine: Engine, prompt: np.ndarray, n: int, mode: str) -> None:  # the Engine holds it
    """The greedy on-device generation's executable (`Engine._device_exec`): mode "compile" compiles it, "run" runs
    it once (no copy back), "get" runs it and copies its result to the host as `Engine.generate` does."""
    settings = engine.settings()
    weights = engine._checked_weights(settings)
    run = engine._device_exec(settings, weights)
    if mode != "compile":
        out = run(weights, *engine.request(prompt, n, ()).loop_args(engine.max_len))
        jax.block_until_ready(out)
        if mode == "get":
            jax.device_get(out).raise_if_error()


def write_hlo(run, hlo_dir: str | None, name: str) -> None:
    """A compiled executable's optimized HLO into hlo_dir/NAME.hlo.txt.gz (nothing without a hlo_dir)."""
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with gzip.open(os.path.join(hlo_dir, f"{name}.hlo.txt.gz"), "wt") as f:
            f.write(run.as_text())


def generation_part_once(engine: Engine, prompt: np.ndarray, n: int, spec: str, hlo_dir: str | None = None):
    """One part of the greedy on-device generation (`jspec.loop`) as its own executable, spec "PART[:MODE[:RUNS]]":
    compiled with EXECUTABLE_MODES[MODE] (default "shipped"), run RUNS times (default 1; XLA records an executable's
    CUDA graphs at its second run, the first running thunk by thunk) and returned. PART: "start" (`start_loop`: the
    fresh state holding the prompt), "start_at" (its Loop moved to the prompt's end, no prefill), "first"
    (start_loop, then `first_round` with no chunk run), "rounds" (start_loop, then n `decode_round`s in a while
    loop, no prefill), "prefill_round" (start_loop, the chunks, the first round), "prefill_rounds" (prefill_round,
    then the n rounds: the generation without its request check), "generate_on_device" (the whole generation jitted
    here, not by the Engine), "unchecked" (it without its request check: no `lax.cond` around its loops), "steps"
    and "prefill_steps" (start_loop or prefill_round, then the bare chain's body on the Loop's state: decode_step,
    argmax, commit, none of a round's bookkeeping), "steps_at" (the steps from start_loop's Loop moved to the
    prompt's end, no prefill: the prefilled position, an empty cache). The rounds and steps run the request's
    max_new times (a runtime value, so `phase_gentime` can time them per token; a static n at 1949890 and before).
    hlo_dir: where its optimized HLO goes (PART_MODE.hlo.txt.gz), if given. Its XLA module is named jit_PART, so an
    --xla_dump_to dump (its thunk sequences) names the part."""
    part, _, rest = spec.partition(":")
    mode, _, runs = rest.partition(":")
    cfg, settings = engine.cfg, engine.settings()
    request = engine.request(prompt, n, ()).loop_args(engine.max_len)

    def start(params, *request):
        return start_loop(params, cfg, settings, *request)

    def rounds(params, loop, trips):  # decode rounds in a while loop
        body = lambda c: (decode_round(params, cfg, settings, c[0]), c[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda c: c[1] < trips, body, (loop, 0))[0]

    def steps(params, loop, trips):  # the bare chain's body on the Loop's state
        body = lambda c: (bare_step(params, cfg, c[0]), c[1] + 1)  # noqa: E731
        return jax.lax.while_loop(lambda c: c[1] < trips, body, (loop.state, 0))[0]

    def at_prompt_end(loop):  # start_loop's Loop moved to the prompt's end, its cache left empty (no prefill)
        return dataclasses.replace(loop, state=dataclasses.replace(loop.state, position=loop.prompt_len))

    def prefilled(params, *request):
        return prefill_round(params, cfg, settings, *request)

    def whole(params, prompt, length, max_new, eos):
        return generate_on_device(params, cfg, prompt, length, max_new, settings, eos)

    def unchecked(params, prompt, length, max_new, eos):  # no request check, so no lax.cond around the loops
        return _generate(params, cfg, settings, prompt, length, max_new, eos, None, None)

    fn = {
        "start": start,
        "start_at": lambda params, *request: at_prompt_end(start(params, *request)),
        "first": lambda params, *request: first_round(params, cfg, settings, start(params, *request)),
        "rounds": lambda params, *request: rounds(params, start(params, *request), request[2]),
        "prefill_round": prefilled,
        "prefill_rounds": lambda params, *request: rounds(params, prefilled(params, *request), request[2]),
        "steps": lambda params, *request: steps(params, start(params, *request), request[2]),
        "prefill_steps": lambda params, *request: steps(params, prefilled(params, *request), request[2]),
        "steps_at": lambda params, *request: steps(params, at_prompt_end(start(params, *request)), request[2]),
        "generate_on_device": whole,
        "unchecked": unchecked,
    }[part]
    fn.__name__ = part
    options = compiler_options() and EXECUTABLE_MODES[mode or "shipped"]
    run = jax.jit(fn).lower(engine.params, *request).compile(options)
    write_hlo(run, hlo_dir, f"{part}_{mode or 'shipped'}")
    for _ in range(int(runs or 1)):
        jax.block_until_ready(run(engine.params, *request))
    return run


def prefill_products_once(params) -> list:
    """A prefill chunk's product (`linear`, 128 rows) with every distinct int4 weight shape of params, once each:
    their executables."""
    shapes, runs = {}, []
    for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Codes)):
        if isinstance(w, Int4Codes):
            shapes.setdefault(tuple(w.shape), w)
    for (k, _), w in shapes.items():
        x = jnp.ones((128, k), jnp.bfloat16)
        runs.append(jax.jit(linear).lower(x, w).compile(compiler_options()))
        runs[-1](x, w).block_until_ready()
    return runs


def chunked_recurrence_once(cfg: ModelConfig, mode: str):
    """The prefill's chunked recurrence (`chunk_gated_delta`, float32) over one 128-position chunk at cfg's linear
    heads (value heads; keys repeated to them, as `jspec.models.hybrid` does), compiled with EXECUTABLE_MODES[mode]
    (default "shipped"), or one part of it (module docstring: "gdn[:MODE]") as shipped, run once: its
    executable."""
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q, k = (jnp.full((128, h, dk), 0.01, jnp.float32) for _ in range(2))
    v = jnp.full((128, h, dv), 0.01, jnp.float32)
    g, beta = jnp.full((128, h), -0.1, jnp.float32), jnp.full((128, h), 0.5, jnp.float32)
    n = 128 // CHUNK
    blocks = jnp.full((h, n, CHUNK, dk), 0.01, jnp.float32)  # [h, n, C, dk]: a chunked q or k
    fn, args = chunk_gated_delta, (q, k, v, g, beta)
    if mode == "trsm":  # the solve of `chunk_gated_delta` at its shapes: [h, n, C, C] unit lower, [h, n, C, dv]
        fn = functools.partial(jax.lax.linalg.triangular_solve, left_side=True, lower=True, unit_diagonal=True)
        system = jnp.broadcast_to(jnp.eye(CHUNK, dtype=jnp.float32), (h, n, CHUNK, CHUNK))
        args = (system, jnp.ones((h, n, CHUNK, dv), jnp.float32))
    elif mode in ("einsum", "einsum_default"):  # its q k^T products, float32 (HIGHEST, as shipped, or default)
        precision = jax.lax.Precision.HIGHEST if mode == "einsum" else None
        fn = functools.partial(jnp.einsum, "hncd,hned->hnce", precision=precision)
        args = (blocks, blocks)
    elif mode == "scan":  # its chunk loop: n state updates in a lax.scan, the products HIGHEST

        def fn(state, k_blocks):
            def body(state, k_c):  # k_c [h, C, dk]
                u = jnp.einsum("hcd,hde->hce", k_c, state, precision=jax.lax.Precision.HIGHEST)
                return state + jnp.einsum("hcd,hce->hde", k_c, u, precision=jax.lax.Precision.HIGHEST), u

            return jax.lax.scan(body, state, jnp.moveaxis(k_blocks, 1, 0))

        args = (jnp.zeros((h, dk, dv), jnp.float32), blocks)
    elif mode == "cumexp":  # its decays: cumsum and exp over [h, n, C]
        fn, args = (lambda g: jnp.exp(jnp.cumsum(g, axis=-1))), (jnp.full((h, n, CHUNK), -0.1, jnp.float32),)
    elif mode == "parts":  # every part above, each its own executable: the parts' kernels without their sequence
        return [chunked_recurrence_once(cfg, part) for part in ("trsm", "einsum", "scan", "cumexp")]
    options = compiler_options() and EXECUTABLE_MODES[mode if mode in EXECUTABLE_MODES else "shipped"]
    run = jax.jit(fn).lower(*args).compile(options)
    jax.block_until_ready(run(*args))
    return run


def distinct_kernels_once(n: int) -> list:
    """n executables of one small elementwise kernel each (a vector of its own length, so no two share a kernel),
    compiled as shipped and run once: n more kernels loaded into the context. Their executables."""
    runs = []
    for i in range(n):
        x = jnp.ones((4096 + 32 * i,), jnp.float32)
        runs.append(jax.jit(lambda x, i=i: jnp.sin(x) * (i + 2.0)).lower(x).compile(compiler_options()))
        runs[-1](x).block_until_ready()
    return runs


def torch_graph_once(nodes: int) -> tuple:
    """A torch CUDA graph of `nodes` kernels (an in-place add on 256 floats each), captured, instantiated and
    replayed once in this process's CUDA context (torch and XLA share the device's primary context): many graph
    nodes alive with no XLA executable among them. (The graph, its tensor)."""
    import torch

    x = torch.zeros(256, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)  # torch's kernel loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(nodes):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    if int(x[0].item()) != nodes + 1:
        raise RuntimeError(f"the torch graph ran {int(x[0].item()) - 1} of its {nodes} kernels")
    return graph, x


def mark_phase(label: str) -> None:
    """Write the phase's marker line to stderr, where XLA's log lines go, so `command_buffer_events` can tell the
    phases apart."""
    print(f"{PHASE_MARK}{label}", file=sys.stderr, flush=True)


def command_buffer_events(log_path: str) -> list[dict]:
    """[{"phase", "events"}] from a run's stderr (--xla-log): per phase, in order, the count of each distinct XLA log
    line about command buffers, its glog prefix cut and its numbers blanked ("#"). With TF_CPP_MIN_LOG_LEVEL=0
    TF_CPP_VMODULE=command_buffer_thunk=3 XLA logs its command buffers' evictions (whenever it builds a new one),
    warm-up runs, recordings, updates (re-recorded when a buffer's address changed) and executions."""
    phases: list[dict] = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith(PHASE_MARK):
                phases.append({"phase": line[len(PHASE_MARK) :].strip(), "events": {}})
            elif phases and "command buffer" in line.lower():
                event = re.sub(r"\d+", "#", GLOG_PREFIX.sub("", line.strip()))[:160]
                phases[-1]["events"][event] = phases[-1]["events"].get(event, 0) + 1
    return phases


def plot_runs(paths: list[str], png: str) -> None:
    """One panel per run JSON: each chain window's ms a step in phase order, the other phases as labelled columns
    (generations' ms a token inside theirs): the process-state bisection at a glance (benchmarks/plots/
    process_state.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(paths), 1, figsize=(11, 1.9 * len(paths)), sharey=True, squeeze=False)
    for ax, path in zip(axes[:, 0], paths, strict=True):
        with open(path) as f:
            run = json.load(f)
        x = 0
        for phase in run["phases"]:
            if "windows" in phase:
                steps = [w["ms_per_step"] for w in phase["windows"]]
                host = phase["phase"].endswith("nographs")  # the chain launched from the host
                ax.plot(range(x, x + len(steps)), steps, "s" if host else "o", color=CHAIN_COLORS[host], ms=4)
                x += len(steps)
            else:
                ax.axvspan(x - 0.4, x + 0.4, color="0.88")
                steps = phase.get("ms_per_step") if phase["phase"].startswith("stepstate") else None
                times = steps or phase.get("ms_per_token", [])  # a chain on a chosen state, or a generation's tokens
                ax.plot(np.linspace(x - 0.3, x + 0.3, len(times)), times, "+" if steps else "x",
                        color="tab:purple" if steps else "tab:orange", ms=5)  # fmt: skip
                label = phase["phase"].replace(":", ":\n") if len(phase["phase"]) > 16 else phase["phase"]
                ax.text(x, 0.96, label, ha="center", va="top", fontsize=6, linespacing=0.9,
                        transform=ax.get_xaxis_transform())  # fmt: skip
                x += 1
        meta = run["meta"]
        ax.set_title(f"{os.path.basename(path)} ({meta['model']}, {meta['commit']})", fontsize=8, loc="left")
        ax.set_xticks([])
        ax.set_ylabel("ms a step", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("chain ms a step (blue; launched from the host: green squares; on a chosen state: purple +),\n"
                 "generations' ms a token (orange x), other phases (grey); a panel a process", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))  # the title's lines above the panels
    fig.savefig(png, dpi=90)
    print(f"plot: {png}")


@dataclasses.dataclass
class Session:
    """What the phases of one run share: the Engine (its prepared weights), the prompt, the generation's length n,
    the options, the chains' per-step timers, the generation's wall timer and the run's output."""

    engine: Engine
    cfg: ModelConfig
    prompt: np.ndarray
    n: int
    opts: argparse.Namespace
    chains: dict[str, Callable[[], float]]  # chain label -> its ms a step, one measurement (`chain_timer`)
    generation: Callable[[int], float]
    out: dict
    step_kernels: Callable[[], dict] | None = None  # the decode step's profiler, compiled at the first "stepprof"
    generation_warm: bool = False  # the Engine's generation executables compiled and run ("warm"; "drop" clears)
    holding: bool = False  # the phase running is a "+KIND:ARG": its executables go to `held`
    held: list = dataclasses.field(default_factory=list)  # executables alive until "drop"
    prefilled: object = None  # the DecodeState a real prefill left ("stepstate:prefilled"), made once


def chain_timer(engine: Engine, cfg: ModelConfig, context: int, label: str, iterations: int) -> Callable[[], float]:
    """The chain `label` compiled: a function timing it once, its ms a step (iterations T minus 1)."""
    wall, trips, _ = chain_walls(engine.params, cfg, context, [label], iterations)[label]
    short = wall(1)
    return lambda: 1e3 * (wall(trips) - short) / (trips - 1)


def phase_chain(s: Session, arg: str) -> dict:
    """The chain LABEL ("SECONDS[:LABEL]") for SECONDS in windows of --window-s, each its median ms a step and the
    GPU's clocks after it."""
    seconds, _, label = arg.partition(":")
    label = label or "1"
    if label not in s.chains:  # compiled at its first phase
        s.chains[label] = chain_timer(s.engine, s.cfg, s.opts.context, label, s.opts.iterations)
    step_ms = s.chains[label]
    start, windows, window_s = time.perf_counter(), [], s.opts.window_s
    while time.perf_counter() - start < (min(float(seconds), 2 * window_s) if s.opts.quick else float(seconds)):
        w0, steps = time.perf_counter(), []
        while time.perf_counter() - w0 < window_s:
            steps.append(step_ms())
        windows.append({"ms_per_step": statistics.median(steps), "steps": len(steps)} | gpu_sample())
    return {"windows": windows}


def warm_generation(s: Session) -> None:
    """The device-loop generation compiled and run (n tokens, then 1), unless it is warm."""
    if not s.generation_warm:
        g0 = time.perf_counter()
        s.generation(s.n), s.generation(1)
        s.out.setdefault("generation_compiled_s", []).append(time.perf_counter() - g0)
        s.generation_warm = True


def phase_drop(s: Session, _: str) -> dict:
    """Every executable the Engine holds (its generations') and every held one ("+KIND:ARG") destroyed: the run's
    only live executables are the chain's (and the step profiler's)."""
    dropped = len(s.engine._executables) + len(s.held)
    s.engine._executables.clear()
    s.held.clear()
    s.generation_warm = False
    gc.collect()
    return {"dropped": dropped}


def ms_per_token(wall: Callable[[int], float], n: int, repeats: int) -> list[float]:
    """Per repeat, ms a token of a generation timer wall(tokens) -> seconds: (wall(n) - wall(1)) / (n - 1), so the
    prefill and the first token cancel."""
    return [1e3 * (wall(n) - wall(1)) / (n - 1) for _ in range(repeats)]


def phase_generate(s: Session, repeats: str) -> dict:
    warm_generation(s)
    return {"ms_per_token": ms_per_token(s.generation, s.n, int(repeats))}


def nested_rounds(params: dict, cfg: ModelConfig, settings: LoopSettings, loop, own=None):
    """`jspec.loop.generation_rounds` with no lax.cond in its while loop's body (so no conditional node inside the
    WHILE's graph): each iteration runs verify rounds while the loop asks for them, then decode rounds while it does
    not (`run_rounds`, at most max_len each): the same rounds in the same order, so the same tokens."""
    most = jnp.int32(settings.max_len)

    def body(lp):
        lp = run_rounds(params, cfg, settings, lp, most, True, own)
        return run_rounds(params, cfg, settings, lp, most, False, own)

    return jax.lax.while_loop(lambda lp: ~lp.done, body, loop)


DRAFTERS = {"mtp": MTPDrafter, "lookup": PromptLookup}


def phase_drafted(s: Session, spec: str) -> dict:
    """Phase "drafted:DRAFTER[:nested]": one on-device generation of n tokens on the run's Engine (k = 1) with a
    drafter (mtp: the model's MTP head; lookup: prompt lookup), compiled and run once, its executable kept by the
    Engine until a "drop" (the Engine keys it by drafter, so a run takes one of the two loop bodies); ":nested": the
    generation's rounds as `nested_rounds` instead of the shipped lax.cond in the loop's body. In the bench's hybrid
    e2e process (greedy, lookup and MTP engines) greedy stayed at ~2.95 ms a token with no async copy in any of its
    executables (bench_hybrid_qwen35_e2e_no_dsf_async_h100.json): does a drafted generation's run enter the process
    state, and is it the cond?"""
    name, _, variant = spec.partition(":")
    if name not in DRAFTERS or variant not in ("", "nested"):
        raise ValueError(f"drafted takes {' or '.join(DRAFTERS)}, optionally ':nested', not {spec!r}")
    shipped_rounds = loop_module.generation_rounds
    t0 = time.perf_counter()
    try:
        if variant:
            loop_module.generation_rounds = nested_rounds  # what jspec.loop._generate calls while it is traced
        r = s.engine.generate(s.prompt, s.n, eos_id=(), on_device=True, drafter=DRAFTERS[name]())
    finally:
        loop_module.generation_rounds = shipped_rounds
    wall, st = time.perf_counter() - t0, r.stats
    greedy = s.engine.generate(s.prompt, s.n, eos_id=(), on_device=True).tokens  # compiled here unless warm
    return {
        "wall_s": wall,
        "verify_steps": st.verify_steps,
        "decode_steps": st.decode_steps,
        "identical": r.tokens == greedy,
    }


def split_rounds(engine: Engine, loop, mode: str, hlo_dir: str | None):
    """The greedy generation's rounds (`jspec.loop.generation_rounds`, until the Loop is done) as an executable of
    their own on a Loop made by another (its buffers donated), compiled with EXECUTABLE_MODES[mode] and run twice on
    copies of `loop`."""
    cfg, settings = engine.cfg, engine.settings()

    def rounds(params, lp):
        return generation_rounds(params, cfg, settings, lp)

    options = compiler_options() and EXECUTABLE_MODES[mode or "shipped"]
    run = jax.jit(rounds, donate_argnums=1).lower(engine.params, loop).compile(options)
    write_hlo(run, hlo_dir, f"split_rounds_{mode or 'shipped'}")
    for _ in range(2):
        jax.block_until_ready(run(engine.params, copy_tree(loop)))
    return run


GENTIME_PARTS = ("generate_on_device", "unchecked", "rounds", "prefill_rounds", "steps", "prefill_steps", "steps_at")
SPLITS = ("split", "splitempty", "splitrest", "splitcopy")  # `phase_gentime`'s two-executable generations


def phase_gentime(s: Session, spec: str) -> dict:
    """A generation's executable ("PART[:MODE[:REPEATS]]", PART of `generation_part_once` whose tokens follow the
    request's max_new: generate_on_device, unchecked, rounds, prefill_rounds, steps, prefill_steps; run twice so its
    graphs are recorded; or "split": prefill_round's executable, then `split_rounds` on its Loop, MODE
    "PREFILL_MODE/ROUNDS_MODE" for one mode each; "splitempty": the split on start_at's Loop (no prefill: the
    prompt's end, an empty cache); "splitrest": the split with the prefill awaited and 1 s of idle
    before the rounds, which cancels in the timing below; "splitcopy": the split with every array of the prefill's
    Loop copied into a new buffer before the rounds) timed as
    `phase_generate` times the Engine's: ms a token over --new-tokens minus 1, REPEATS times (default 3); with a
    fourth field "prof", then profiled: its GPU kernels per token (`device_loop_profile.token_kernels`); destroyed
    after."""
    part, _, rest = spec.partition(":")
    mode, _, rest = rest.partition(":")
    repeats, _, prof = rest.partition(":")
    if part not in (*GENTIME_PARTS, *SPLITS):
        raise ValueError(f"gentime times one of {', '.join(GENTIME_PARTS + SPLITS)}, not {part!r}")
    prompt, length, _, eos = s.engine.request(s.prompt, s.n, ()).loop_args(s.engine.max_len)
    if part in SPLITS:  # prefill_round's (or start_at's) executable, then the rounds': two calls
        prefill_mode, _, rounds_mode = mode.partition("/")  # "PREFILL_MODE/ROUNDS_MODE", or one MODE for both
        loop_part = "start_at" if part == "splitempty" else "prefill_round"
        first = generation_part_once(s.engine, s.prompt, s.n, f"{loop_part}:{prefill_mode}:2", s.opts.hlo_dir)
        loop = first(s.engine.params, prompt, length, np.int32(s.n), eos)
        rounds = split_rounds(s.engine, loop, rounds_mode or prefill_mode, s.opts.hlo_dir)

        def run(params, *request):  # the prefill's Loop, awaited and idle 1 s ("splitrest") or copied ("splitcopy")
            loop = first(params, *request)
            if part == "splitrest":
                jax.block_until_ready(loop)
                time.sleep(1.0)
            if part == "splitcopy":  # every array of the Loop copied into a new buffer first
                loop = jax.tree.map(jnp.copy, loop)
            return rounds(params, loop)

    else:
        run = generation_part_once(s.engine, s.prompt, s.n, f"{part}:{mode}:2", s.opts.hlo_dir)

    def wall(n: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(run(s.engine.params, prompt, length, np.int32(n), eos))
        return time.perf_counter() - t0

    timed_ms = {"ms_per_token": ms_per_token(wall, s.n, int(repeats or 3))}
    return timed_ms | ({"kernels_per_token": token_kernels(wall, s.n)} if prof else {})


def phase_stepprof(s: Session, _: str) -> dict:
    s.step_kernels = s.step_kernels or step_profiler(s.engine.params, s.cfg, s.opts.context)
    return {"step": s.step_kernels and s.step_kernels()}


STATE_GROUPS = ("kv", "ssm", "conv", "tokens", "hidden")  # a DecodeState's leaves, by what they hold


def state_group(path) -> str:
    """The STATE_GROUPS name of a DecodeState leaf's path ("other" for position and slot)."""
    key = jax.tree_util.keystr(path)
    if key.startswith(".cache"):
        return "ssm" if "'ssm'" in key else "conv" if "'conv'" in key else "kv"
    return key[1:] if key[1:] in STATE_GROUPS else "other"


def step_state(s: Session, which: str):
    """The decode state STATE names, at the Engine's max_len: "prefilled" (the Loop's after `prefill_round`'s
    executable, destroyed after one run, on the session's prompt: the real prefill's caches and recurrent states,
    position = prompt length; made once a session), "random" (`random_state` at that position: the bare chain's kind
    of state), "random+prefill" (random, made after a run of prefill_round's executable, compiled again), "zeros"
    (`init_state`'s zeros at that position), "start" (`start_loop`'s: the prompt written, position 0),
    "prefilled-GROUP" (prefilled with the leaves of one of STATE_GROUPS taken from random)."""
    group = which.removeprefix("prefilled-") if which.startswith("prefilled-") else None
    if which not in ("prefilled", "random", "random+prefill", "zeros", "start") and group not in STATE_GROUPS:
        raise ValueError(
            f"stepstate takes prefilled[-GROUP] (GROUP: {', '.join(STATE_GROUPS)}), random, random+prefill, zeros "
            f"or start, not {which!r}"
        )
    engine, cfg, position = s.engine, s.cfg, len(s.prompt)
    request = engine.request(s.prompt, s.n, ()).loop_args(engine.max_len)
    if which == "zeros":
        return dataclasses.replace(init_state(cfg, engine.max_len, jnp.bfloat16), position=jnp.asarray(position))
    if which == "start":
        return generation_part_once(engine, s.prompt, s.n, "start")(engine.params, *request).state
    if which == "random+prefill" or (which.startswith("prefilled") and s.prefilled is None):
        s.prefilled = generation_part_once(engine, s.prompt, s.n, "prefill_round")(engine.params, *request).state
    if which == "prefilled":
        return s.prefilled
    random = random_state(cfg, engine.max_len, position, jnp.bfloat16, 1)
    if group is None:  # random, random+prefill
        return random
    pick = lambda path, real, rand: rand if state_group(path) == group else real  # noqa: E731
    return jax.tree_util.tree_map_with_path(pick, s.prefilled, random)


def phase_stepstate(s: Session, spec: str) -> dict:
    """The bare chain (`chain_walls`' "1") on the state STATE names (`step_state`; spec "STATE[:prof]"): its ms a
    step, (wall(T) - wall(1)) / (T - 1) with T as many steps as the state's cache has room for (one row tile kept
    free, as the Engine keeps it; at most --iterations), 5 times; with ":prof", then the decode step's kernels on it
    (`step_profiler`, 3 calls)."""
    which, _, prof = spec.partition(":")
    state = step_state(s, which)
    position = int(state.position)
    trips = min(s.opts.iterations, s.engine.max_len - position - ROW_TILE)  # the Engine's own margin
    if trips < 2:
        raise ValueError(f"stepstate:{which}: the cache has room for {trips} steps from {position}")
    wall, _, _ = chain_walls(s.engine.params, s.cfg, position, ["1"], trips, state=state)["1"]
    ms = ms_per_token(wall, trips, 5)  # a step's ms: one token a step
    profiler = prof and step_profiler(s.engine.params, s.cfg, s.opts.context, state=state)
    return {"position": position, "trips": trips, "ms_per_step": ms, "step": profiler and profiler()}


def phase_context(what: str) -> Callable[[Session, str], dict]:
    """The runner of "stack:B" / "pending:N" / "cacheconfig:C" (`set_context`)."""

    def runner(_: Session, value: str) -> dict:
        try:
            set_context(what, int(value))
            return {}
        except Exception as e:  # no libcuda (a CPU smoke run), or the driver refused: recorded, the run goes on
            return {"ctx_error": one_line(e)}

    return runner


def gemm_once(mode: str):
    """A bf16 4096 x 4096 XLA dot compiled with EXECUTABLE_MODES[mode] (default "shipped"), run once: its executable."""
    a = jnp.ones((4096, 4096), jnp.bfloat16)
    run = jax.jit(jnp.dot).lower(a, a).compile(compiler_options() and EXECUTABLE_MODES[mode or "shipped"])
    run(a, a).block_until_ready()
    return run


def phase_alloc(_: Session, gib: str) -> dict:
    big = jnp.zeros((int(float(gib) * 2**29),), jnp.uint16)
    big.block_until_ready()
    del big
    return {}


def phase_d2h(_: Session, what: str) -> dict:
    """Copy device arrays made here to the host (`jax.device_get`): "scalar" one int32, "tree" five small int32 arrays
    at once (a `DeviceGeneration`'s shapes), "array" one int32 [4096]; no generation runs."""
    made = {
        "scalar": lambda: jnp.asarray(7, jnp.int32) + 1,
        "tree": lambda: tuple(jnp.arange(n, dtype=jnp.int32) + 1 for n in (512, 1, 1, 8, 1)),
        "array": lambda: jnp.arange(4096, dtype=jnp.int32) + 1,
    }[what]()
    jax.block_until_ready(made)
    t0 = time.perf_counter()
    jax.device_get(made)
    return {"wall_s": time.perf_counter() - t0}


def phase_rest(s: Session, seconds: str) -> dict:
    time.sleep(min(float(seconds), 1.0) if s.opts.quick else float(seconds))
    return {}


def timed(run: Callable[[Session, str], object]) -> Callable[[Session, str], dict]:
    """A runner recording the seconds run(session, arg) took, compiles included; what run returns (its executables)
    is held when the phase is a "+KIND:ARG", else destroyed; and the custom calls its executables make."""

    def runner(s: Session, arg: str) -> dict:
        t0 = time.perf_counter()
        executables = run(s, arg)
        wall = time.perf_counter() - t0
        if s.holding:
            s.held.append(executables)
        listed = executables if isinstance(executables, list) else [executables]  # otherchain: its walls, no text
        texts = [e.as_text() for e in listed if isinstance(e, jax.stages.Compiled)]
        return {"wall_s": wall, "custom_calls": sorted({c for t in texts for c in re.findall(CUSTOM_CALL, t)})}

    return runner


PHASE_RUNNERS = {  # kind -> runner(session, the phase's argument) -> what the phase records (module docstring)
    "roofline": lambda s, _: {"read_Bps": _xla_sum_Bps(2**24 if s.opts.quick else 2**30)},  # bf16: 2 GiB on a GPU
    "rest": phase_rest,
    "chain": phase_chain,
    "warm": lambda s, _: warm_generation(s) or {},
    "generate": phase_generate,
    "drafted": phase_drafted,
    "gentime": phase_gentime,
    "hostgen": lambda s, t: {"wall_s": generation_wall(s.engine, s.prompt, on_device=False)(int(t))},
    "genpart": timed(lambda s, part: generation_part_once(s.engine, s.prompt, s.n, part, s.opts.hlo_dir)),
    "drop": phase_drop,
    "devexec": timed(lambda s, mode: device_exec_once(s.engine, s.prompt, s.n, mode)),
    "otherchain": timed(lambda s, label: chain_walls(s.engine.params, s.cfg, s.opts.context, [label], 3)),
    "prefill": timed(lambda s, mode: prefill_once(s.engine.params, s.cfg, s.prompt, mode)),
    "attn": timed(lambda s, _: prefill_attention_once(s.cfg, s.opts.context)),
    "dqgemm": timed(lambda s, _: prefill_products_once(s.engine.params)),
    "gdn": timed(lambda s, mode: chunked_recurrence_once(s.cfg, mode)),
    "gemm": timed(lambda s, mode: gemm_once(mode)),
    "kernels": timed(lambda s, n: distinct_kernels_once(int(n))),
    "torchgraph": timed(lambda s, n: torch_graph_once(int(n))),
    "stepprof": phase_stepprof,
    "stepstate": phase_stepstate,
    "alloc": phase_alloc,
    "d2h": phase_d2h,
    "stack": phase_context("stack"),
    "pending": phase_context("dev_runtime_pending_launches"),
    "cacheconfig": phase_context("cache"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the run's JSON (required unless --plot)")
    ap.add_argument("--plot", metavar="PNG", help="draw the run JSONs given as arguments (`plot_runs`) and stop")
    ap.add_argument("runs", nargs="*", help="run JSONs, with --plot")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--model", default="qwen3.5")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--iterations", type=int, default=33)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--phases", default=PHASES, help="what runs, in order (module docstring)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shape, short phases")
    ap.add_argument(
        "--xla-log",
        metavar="LOG",
        help="the file this process's stderr goes to (run it with TF_CPP_MIN_LOG_LEVEL=0 "
        "TF_CPP_VMODULE=command_buffer_thunk=3 and 2> LOG): each phase's XLA command-buffer events counted into "
        "the JSON (`command_buffer_events`)",
    )
    ap.add_argument("--hlo-dir", help="a folder for the optimized HLO of every genpart / gentime executable")
    ap.add_argument(
        "--engine-mode",
        choices=sorted(EXECUTABLE_MODES),
        help="compile the Engine's executables (its generations, the chains) with this mode's options, not the "
        "shipped ones (the meta's compiler_options say which)",
    )
    opts = ap.parse_args()
    if opts.plot:
        return plot_runs(opts.runs, opts.plot)
    if not opts.out:
        ap.error("--out is required")
    if opts.engine_mode:
        engine_module.GPU_COMPILER_OPTIONS.update(EXECUTABLE_MODES[opts.engine_mode])
    t0 = time.perf_counter()
    mark_phase("setup")
    cfg = model_config(opts.model, opts.quick)
    n = 9 if opts.quick else opts.new_tokens
    engine = Engine(random_int4_params(cfg, 0, True), cfg, max_len=opts.context + n + 16, k=1, prefill_chunk=128)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (opts.context,)).astype(np.int32)
    out = {
        "meta": experiment_meta(opts.commit, model=opts.model, context=opts.context, phases=opts.phases),
        "idle": gpu_sample() | context_sample(),
        "phases": [],
    }
    s = Session(
        engine,
        cfg,
        prompt,
        n,
        opts,
        {"1": chain_timer(engine, cfg, opts.context, "1", opts.iterations)},
        generation_wall(engine, prompt),
        out,
    )
    for phase in opts.phases.split(","):
        kind, _, arg = phase.partition(":")
        s.holding = kind.startswith("+")
        kind = kind.removeprefix("+")
        if kind not in PHASE_RUNNERS:
            raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASE_RUNNERS)}")
        mark_phase(phase)
        result = PHASE_RUNNERS[kind](s, arg)
        out["phases"].append(
            {"phase": phase, "t_s": time.perf_counter() - t0} | result | gpu_sample() | context_sample()
        )
        print(f"  {out['phases'][-1]}", flush=True)
    if opts.xla_log:
        mark_phase("end")
        out["command_buffer_events"] = command_buffer_events(opts.xla_log)
    save_experiment(out, opts.out, t0)


if __name__ == "__main__":
    main()
