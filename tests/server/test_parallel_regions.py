"""The server's loop thread and its default executor run parallel regions serially, so that
the model thread's OpenMP team is the process's only one (pyserve/executor/threads.py)."""

import asyncio
import threading

import torch

from pyserve.server.app import keep_parallel_regions_on_the_model_thread


def test_the_loop_thread_and_its_default_executor_run_serially():
    seen = {}

    def loop_thread():
        loop = asyncio.new_event_loop()
        try:
            seen["before"] = torch.get_num_threads()
            keep_parallel_regions_on_the_model_thread(loop)
            seen["loop"] = torch.get_num_threads()
            seen["executor"] = loop.run_until_complete(loop.run_in_executor(None, torch.get_num_threads))
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert (seen["loop"], seen["executor"]) == (1, 1)
    assert seen["before"] == torch.get_num_threads()  # this (another) thread keeps its count
