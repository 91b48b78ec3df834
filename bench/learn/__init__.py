"""Active learning: uncertainty+diversity selection against random
(:mod:`bench.learn.active_learning`) and its ceiling with a perfect uncertainty
(:mod:`bench.learn.active_learning_ceiling`)."""
