"""Round control on the server: a federated round (:mod:`.federation`), who is to blame
for a failed one (:mod:`.blame`) and what follows (:mod:`.recovery`), nodes that join
mid-run (:mod:`.joins`), the re-planning hook (:mod:`.replan_hook`) and the log tables
(:mod:`.report`)."""
