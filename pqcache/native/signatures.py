"""The C functions' signatures for ctypes (argument and result types), set once on the loaded library: a wrong
type here is a wrong value in C, so each line mirrors its function's C declaration."""

from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and result types of every kernel of the native library."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.int8_rows_mm.restype = ctypes.c_int
    lib.int8_rows_mm.argtypes = [pointer] * 4 + [size] * 3
    lib.int8_rows_candidates.restype = size
    lib.int8_rows_candidates.argtypes = [pointer] * 5 + [ctypes.c_float, pointer, pointer] + [size] * 3
    lib.gather_dot.restype = None
    lib.gather_dot.argtypes = [pointer, ctypes.c_int, size, pointer, size, pointer, size, size, pointer]
    lib.gather_weighted_sum.restype = ctypes.c_int
    lib.gather_weighted_sum.argtypes = [pointer, ctypes.c_int, size, pointer, size, pointer, size, size, pointer]
    lib.layer_qkv.restype = lib.layer_out.restype = lib.attend_row.restype = ctypes.c_int
    lib.layer_qkv.argtypes = [pointer] * 5
    lib.layer_out.argtypes = [pointer] * 4
    lib.attend_row.argtypes = [pointer, size, pointer, pointer, size, size, size, size, size, ctypes.c_float, pointer]
    lib.attend_picks.restype = lib.pq_search.restype = lib.combine_top.restype = ctypes.c_int
    lib.attend_picks.argtypes = [pointer, size, pointer, pointer, size, size, size, size, size, ctypes.c_float, size]
    lib.attend_picks.argtypes += [pointer] * 4 + [size] * 2 + [pointer, size, size, pointer, pointer]
    lib.pq_search.argtypes = [pointer, size, size, size, pointer, size, size, pointer, ctypes.c_int, size]
    lib.pq_search.argtypes += [pointer] * 3
    lib.combine_top.argtypes = [pointer, size, size, pointer, ctypes.c_int, size, pointer]
    lib.pq_tables.restype = lib.pq_encode.restype = None
    lib.pq_tables.argtypes = [pointer, size, pointer, size, size, size, pointer]
    lib.pq_encode.argtypes = [pointer, pointer, pointer, size, size, size, pointer, size, pointer]
    lib.pq_step.restype = ctypes.c_int
    lib.pq_step.argtypes = [pointer] + [size] * 3 + [ctypes.c_float, pointer, pointer, size, ctypes.c_int, size, size]
    lib.pq_step.argtypes += [pointer]  # row_scale
    lib.pq_step.argtypes += [pointer] * 3 + [size] * 3 + [pointer] * 5 + [size, pointer, pointer]  # ..., t, T, V
    lib.pq_step.argtypes += [ctypes.c_float, size, pointer]  # mass, mass_floor, kept
    lib.pq_append.restype = None
    lib.pq_append.argtypes = [pointer] * 2 + [size] * 2 + [pointer] * 2 + [size, pointer]
    lib.layer_window_step.restype = ctypes.c_int
    lib.layer_window_step.argtypes = [pointer] * 6 + [size] * 4 + [ctypes.c_float, pointer]
