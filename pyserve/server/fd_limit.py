"""The open-file limit, raised at start-up as vLLM raises it: every client connection is a
file descriptor, and a soft limit of 1,024 (a common default) caps a server at about 1,000
concurrent streams whatever its hardware."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger("pyserve")

# when the hard limit is unlimited, the kernel still refuses a soft limit over fs.nr_open
# (1,048,576 by default)
_UNLIMITED_TARGET = 1 << 20


def raise_open_file_limit() -> int:
    """Raises RLIMIT_NOFILE's soft limit to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s; the server "
                           "holds at most about %d connections (raise it with ulimit -n)",
                           soft, target, exc, soft)
            return soft
        logger.info("start-up: open-file limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
        return target
    logger.info("start-up: open-file limit (RLIMIT_NOFILE) is %d", soft)
    return soft
