"""The transports: one round of one pipeline, run by a :class:`.runner.Runner`.

The three runners (:mod:`.relay`, :mod:`.direct`, :mod:`.stream`) import none of each
other, only the shared modules: :mod:`.runner` (what a runner is given and returns),
:mod:`.hops` (what the server-driven transports share), :mod:`.guard` (finite or
rejected), :mod:`.deadlines`; and the stream's data plane (:mod:`.channel`,
:mod:`.stream_tls`, :mod:`.stream_probe`)."""
