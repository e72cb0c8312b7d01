"""Asynchronous learners and their syncer as separate jobs (Decoupled
DiLoCo across processes that come and go): :mod:`.store` (the exchange,
through Orbax), :mod:`.syncer`, :mod:`.learner`, :mod:`.wire` (payload
codecs) and :mod:`._procs` (a learner of several processes). The merge rules are :mod:`loc_opt.outer.decoupled_diloco`'s; the
staleness options are :mod:`loc_opt.outer.staleness`."""
