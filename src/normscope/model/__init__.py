"""The model toolkit that every model-level command stands on (scan, diff, trace, gradflow): inputs, private
copies, leaving a model untouched, progress.

Public names: :func:`.copies.on_meta`, :func:`.copies.private_copy`, :func:`.copies.untouched`, :func:`.copies.redrawn`,
:func:`.copies.stored_params`, :func:`.inputs.arguments`, :func:`.inputs.default_inputs`, :func:`.inputs.describe`,
:func:`.inputs.token_inputs`, :func:`.inputs.vocabulary_size`, :func:`.progress.progress`,
:func:`.streaming.streamed` (a model larger than memory, read from its files at each module's call),
:func:`.streaming.is_streamed`.
"""

from __future__ import annotations

from .copies import offloaded, on_meta, private_copy, redrawn, stored_params, untouched
from .inputs import arguments, default_inputs, describe, token_inputs, vocabulary_size
from .progress import Progress, progress
from .streaming import is_streamed, streamed

__all__ = ["Progress", "arguments", "default_inputs", "describe", "is_streamed", "offloaded", "on_meta",
           "private_copy", "progress", "redrawn", "stored_params", "streamed", "token_inputs", "untouched",
           "vocabulary_size"]
