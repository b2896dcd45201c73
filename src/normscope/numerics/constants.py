"""Every tolerance constant of the acceptance battery and the error model, named, with its reason.

The derived bounds (:mod:`normscope.numerics.tolerance`) are written in the unit roundoff u of a dtype
(:data:`normscope.dtypes.UNIT_ROUNDOFF`); what is left are the factors below. One line each says why the
number is what it is. Nothing else in the battery writes a tolerance as a literal.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- the error model
#: A target may err by this many times a faithful emulation's own error: another faithful order errs as much again.
FAITHFUL_FACTOR = 2.0
#: k = SUMMATION_LOG2·log2(n) + SUMMATION_TERMS: pairwise sums of n terms err by ~log2(n) roundings, two sums.
SUMMATION_LOG2 = 2.0
#: ... plus a few roundings outside the sums (the mean's division, the root, the ε addition).
SUMMATION_TERMS = 8.0
#: Roundings at the output dtype allowed per element (x̂, γ·x̂, + β, the cast), in units of u(dtype)·|y|.
OUTPUT_ROUNDINGS = 4.0
#: Invariance/dependency atol in u(dtype)·max(1, output scale): ≥ 1 ulp (two rounded outputs), more with more bits.
ATOL_UNITS = {"float64": 64, "float32": 16, "float16": 4, "bfloat16": 4}
#: γ/β recovered by probing: the two ±u patterns' disagreement is one measurement's noise; allow it twice.
RECOVERY_NOISE_FACTOR = 2.0
#: The resolution of a probed γ/β (relative, and absolute near 0) when the measurement is not coarser.
RECOVERY_TOLERANCE = 1e-3
#: ... never finer than this many units of the probing dtype's rounding (bfloat16-only targets probe at bf16).
RECOVERY_ULPS = 8.0
#: A faithful emulation erring by more than this fraction of the output scale tells nothing: a skip.
FAITHFUL_USELESS = 0.5

# ---------------------------------------------------------------------------------------------- two calls
#: Findings that compare two calls allow this many times the measured call-to-call noise.
NOISE_FLOOR_FACTOR = 2.0
#: Call-to-call noise is relative to each output, floored at this fraction of the outputs' RMS (near 0).
RELATIVE_NOISE_FLOOR = 1e-2
#: A centred norm must not move under a common shift: only the inputs' new rounding, a few atols.
SHIFT_ATOL_FACTOR = 4.0
#: A change the contract predicts (an RMS norm's shift, a dependency) is matched within this fraction of it.
CHANGE_RTOL = 0.01

# ---------------------------------------------------------------------------------------------- rules
#: Rounding-order rule: the target may sit this many ulps farther from its contract than from the nearest other.
ROUNDING_MARGIN_ULPS = 0.02
#: ... and never more than this many ulps (mean) from its own contract's rounding.
ROUNDING_MAX_ULPS = 2.0
#: Running-statistics update: the momentum must match within this absolute ...
MOMENTUM_ATOL = 1e-6
#: ... plus this relative part (float32 buffers hold the updated statistics to ~1e-7).
MOMENTUM_RTOL = 1e-4
#: Below this a momentum counts as zero: the running statistics did not move.
MIN_MOMENTUM = 1e-6
#: A probed γ is the exposed parameter up to a scale in [1/√2, √2] (÷d vs ÷(d−1) for d ≥ 2), rounded outward.
GAMMA_SCALE_MIN = 0.7071
#: ... the upper end of that window.
GAMMA_SCALE_MAX = 1.4143
#: A probed effective |γ| at or below this means the output does not follow the input.
ZERO_GAMMA = 1e-6
#: γ/β broadcast: the relative tolerance of a map probed at float64 (float32 uses the recovery tolerance).
AFFINE_FLOAT64_TOLERANCE = 1e-6

# ---------------------------------------------------------------------------------------------- experiments
#: The variance-algorithm offset M = s·u(c)^-OFFSET_EXPONENT: one-pass E[x²] − E[x]² cancels, two-pass survives.
OFFSET_EXPONENT = 0.65
#: ... capped at OFFSET_CAP/u(dtype), so the spread survives the input's own rounding.
OFFSET_CAP = 0.05
#: A one-pass emulation must leave the two-pass bound by this factor, else the algorithms do not separate.
SEPARATION = 4.0
#: The variance-algorithm spread sits this many standard deviations of the knee above it (ε does not hide it).
SPREAD_ABOVE_KNEE = 10.0
#: The tiny-variance finding that every contract gets, ε or not.
TINY_VARIANCE = 1e-12
#: A second tiny-variance point this fraction below the knee, where ε alone sets the gain.
BELOW_KNEE = 0.01
#: No knee points below this variance: float32 inputs of that size are subnormal or zero.
KNEE_FLOOR = 1e-36

# ---------------------------------------------------------------------------------------------- separation
#: Two contracts' emulations separate only when the farther mean distance (ulps) is this many times the nearer.
SEPARATION_RATIO = 1.5
#: ... and the nearer one is closer by ½ ulp at clearly more elements: a sign test of at least this z (one-sided
#: p ≈ 3e-5; a few outlying elements cannot decide, 16 of 16 elements one way can).
SEPARATION_Z = 4.0
#: ... with both means floored at this many ulps (sub-0.05-ulp differences are the flooring of ulps near 0).
SEPARATION_FLOOR_ULPS = 0.05
