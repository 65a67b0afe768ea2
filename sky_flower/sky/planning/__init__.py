"""Planning on the server: the benchmark round (:mod:`.benchmark`), the plan and the
pipelines it gives (:mod:`.planning`), online re-planning (:mod:`.replan`). Imports
nothing from round control (:mod:`sky_flower.sky.rounds`)."""
