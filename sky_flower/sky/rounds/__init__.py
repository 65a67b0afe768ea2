"""Round control on the server, the parts :class:`sky_flower.strategies.sky.SkyStrategy`
calls from its loop (each handed values, each returning values; the loop alone writes
its :class:`.state.RunState`): the benchmark round and nodes that join mid-run
(:mod:`.joins`), the planner (:mod:`.planner`), the round executor and the evaluator
(:mod:`.executor`, over a federated round: :mod:`.federation`), the failure policy
(:mod:`.recovery`, judging faults with :mod:`.blame`); the typed records
(:mod:`.records`), observers (:mod:`.hooks`) and the log tables (:mod:`.report`)."""
