"""Row-tile kernels for exact speculative decoding: int4 matmul and decode/verify attention.

Every kernel here obeys the row-tile rule (docs/design.md, rule 1): row r of the output depends only on row r of
the input, bit for bit, whatever the number of rows M <= ROW_TILE.
"""

from pallas_kernels.attention import attention
from pallas_kernels.backend import ROW_TILE, get_backend, set_backend, use_backend
from pallas_kernels.int4 import Int4Weight, dequantize, pack, quantize
from pallas_kernels.int4_ws import Int4Codes
from pallas_kernels.matmul import Int4Halves, linear, rows_matmul
from pallas_kernels.prefill_attention import chunk_attention
from pallas_kernels.prepare import prepare_params, prepare_reference, prepare_ws, resolve_prepare

__all__ = [
    "ROW_TILE",
    "Int4Codes",
    "Int4Halves",
    "Int4Weight",
    "attention",
    "chunk_attention",
    "dequantize",
    "get_backend",
    "linear",
    "pack",
    "prepare_params",
    "prepare_reference",
    "prepare_ws",
    "quantize",
    "resolve_prepare",
    "rows_matmul",
    "set_backend",
    "use_backend",
]
