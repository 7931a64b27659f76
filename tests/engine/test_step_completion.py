"""StepCompletion: the eventfd a CUDA stream's host function writes (here another thread
writes it, as the CUDA driver's thread would) wakes the event loop's await of that step."""

import asyncio
import os
import threading

from pyserve.engine.completion import StepCompletion


def test_a_write_from_another_thread_completes_the_armed_step():
    async def main():
        loop = asyncio.get_running_loop()
        completion = StepCompletion(loop)
        try:
            for delay in (0.0, 0.05):  # written before and after the loop starts waiting
                done = completion.arm()
                threading.Timer(delay, os.eventfd_write, (completion.fd, 1)).start()
                await asyncio.wait_for(done, timeout=5)
            # a notification with no step waiting is consumed and ignored
            os.eventfd_write(completion.fd, 1)
            await asyncio.sleep(0.05)
            later = completion.arm()
            await asyncio.sleep(0.05)
            assert not later.done()
        finally:
            completion.close()

    asyncio.run(main())
