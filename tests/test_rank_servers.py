"""The ranks of the suite fork from one server (conftest.py) that has imported SERVER_PRELOAD:
every preload is there in every rank (a module the server could not import was skipped without
a word: rank_processes.preload), with the one compile thread preload sets (no compile workers)."""

from conftest import SERVER_PRELOAD
from rank_processes import missing_preloads


def _rank_inherits_the_preloads(rank, world_size):
    import torch._inductor.config

    assert missing_preloads(rank, world_size, SERVER_PRELOAD) == []
    assert torch._inductor.config.compile_threads == 1


def test_every_rank_inherits_the_servers_preloads(distributed):
    distributed(_rank_inherits_the_preloads, 2)
