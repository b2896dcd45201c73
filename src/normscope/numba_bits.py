"""A float32's bit pattern and back inside numba code, as LLVM bitcasts: no memory round trip, so a loop that
moves between a value and its bits (rounding to a 16-bit format, integer reductions over float keys) stays one
loop that LLVM can vectorise. numba has no reinterpreting cast of a scalar of its own."""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bit pattern is ``bits``: an integer, taken as its low 32 bits (numba widens int32
    arithmetic to int64; the argument is cast back)."""
    if not isinstance(bits, types.Integer):
        return None
    width = types.int32 if bits.signed else types.uint32

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(width), codegen


@intrinsic
def as_uint32(typingctx, value):
    """The bit pattern of a float32 ``value``, as a uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(value), codegen
