"""The node side of the Sky protocol: a ClientApp's handlers (:mod:`.client`), a stage's
state as records (:mod:`.stage_state`) and the stage bodies of the ``direct`` and
``stream`` rounds (:mod:`.direct_node`, :mod:`.stream_node`). Imports nothing from round
control (:mod:`sky_flower.sky.rounds`)."""
