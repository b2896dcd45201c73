"""A float32's bit pattern and back inside numba code, as LLVM bitcasts: no memory round trip, so a loop that
moves between a value and its bits (rounding to a 16-bit format, integer reductions over float keys) stays one
loop that LLVM can vectorise. numba has no reinterpreting cast of a scalar of its own."""

from __future__ import annotations

from llvmlite import ir
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


def _hardware_half() -> bool:
    """Whether this CPU converts between float16 and float32 itself (x86 F16C; every 64-bit ARM): there LLVM's
    ``fpext``/``fptrunc`` of a half become those instructions, elsewhere calls into a runtime library that a numba
    JIT may not link."""
    try:
        import platform

        import llvmlite.binding as llvm

        if platform.machine().lower() in ("aarch64", "arm64"):
            return True
        return bool(llvm.get_host_cpu_features().get("f16c"))
    except Exception:
        return False


#: float16 conversions by the CPU's own instructions (:func:`half_to_float32`, :func:`float32_to_half`); read once,
#: frozen into numba's compiled code (whose on-disk cache is kept per CPU model and features)
HARDWARE_HALF = _hardware_half()


@intrinsic
def half_to_float32(typingctx, bits):
    """The float32 value of the float16 bit pattern ``bits`` (a uint16), exactly: LLVM's ``fpext`` (on x86 with
    F16C, ``vcvtph2ps``, eight at a time in a vectorised loop). Only where :data:`HARDWARE_HALF`."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def float32_to_half(typingctx, value):
    """The float16 bit pattern nearest to a float32 ``value`` (ties to even; overflow to ±inf, subnormals exact, NaN
    stays NaN): LLVM's ``fptrunc`` (``vcvtps2ph`` with F16C). Only where :data:`HARDWARE_HALF`."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen
