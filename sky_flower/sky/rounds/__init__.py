"""Round control on the server, the parts :class:`sky_flower.strategies.sky.SkyStrategy`
is composed of, sharing one :class:`.state.RunState`: the benchmark round and nodes that
join mid-run (:mod:`.joins`), the planner (:mod:`.planner`), the round executor and the
evaluator (:mod:`.executor`, over a federated round: :mod:`.federation`), the failure
policy (:mod:`.recovery`, judging faults with :mod:`.blame`); observers
(:mod:`.hooks`) and the log tables (:mod:`.report`)."""
