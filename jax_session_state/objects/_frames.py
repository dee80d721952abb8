"""A ring sized in frames, as Self-Forcing sizes its rolling cache, turned into the token sizes a ring keeps.

Self-Forcing's causal Wan model keeps ``local_attn_size`` frames of K/V, the
first ``sink_size`` of them for ever: the window counts the sink frames and
the frame being generated.  So a frame ``f`` sees frame ``g <= f`` when
``g < sink_size`` or ``f - g < local_attn_size - sink_size``; read at the
frame's last position, that is a token window of ``(local_attn_size -
sink_size) * N`` and ``sink_size * N`` sink tokens.
"""

from __future__ import annotations

from jax_session_state._core import _validation as v
from jax_session_state.errors import PayloadError, PayloadTypeError

__all__ = ["ring_in_tokens"]


def ring_in_tokens(owner: str, frame: int | None, window_frames: int | None, sink_frames: int,
                   window: int | None, sink: int, max_staged: int | None) -> tuple[int | None, int, int | None]:
    """``(window, sink, max_staged)`` in tokens, from a ring given in frames (Self-Forcing's
    ``local_attn_size`` and ``sink_size``: the window counts the sink frames and the current frame).

    Raises:
      PayloadTypeError: frames without ``frame``, or given beside ``window`` / ``sink``.
      PayloadError: ``sink_frames`` leaves no frame for the window.
    """
    if window_frames is None:
        if sink_frames:
            raise PayloadTypeError(f"{owner}: sink_frames= applies only with window_frames=.")
        if frame is not None and window is not None and max_staged is None:
            max_staged = frame
        return window, sink, max_staged
    if frame is None:
        raise PayloadTypeError(f"{owner}: window_frames= counts frames; it needs frame= (tokens per frame).")
    if window is not None or sink:
        raise PayloadTypeError(f"{owner}: give the ring in frames (window_frames=, sink_frames=) or in tokens "
                               f"(window=, sink=), not both; got window={window}, sink={sink}.")
    window_frames = v.positive_int(owner, "window_frames", window_frames)
    sink_frames = v.positive_int(owner, "sink_frames", sink_frames, minimum=0)
    if sink_frames >= window_frames:
        raise PayloadError(f"{owner}: window_frames={window_frames} counts the sink frames and the current frame, "
                           f"so it must exceed sink_frames={sink_frames}.")
    return (window_frames - sink_frames) * frame, sink_frames * frame, frame if max_staged is None else max_staged
