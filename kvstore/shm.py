"""Same-host shared-memory reads: the node's pool segment and the client's mapping of it.

A store node keeps its slot pool in an anonymous shared-memory file
(``memfd_create``): it has no name in ``/dev/shm``, so nothing can leak there,
and its memory goes back to the system when the node exits (or is killed) and
the last client mapping of it is gone. The node advertises, in its registry
entry (kvstore/index.py):

- ``host_id``: :func:`host_id` (hostname, kernel boot id, pid namespace);
- ``shm_path``: ``/proc/<node pid>/fd/<fd>``, through which a process of the same
  user on the same host opens the segment;
- ``shm_id``: ``<st_dev>:<st_ino>:<bytes>`` of the segment, which the client checks
  after opening (a recycled pid or fd number never passes for the segment).

A client whose :func:`host_id` equals the node's maps the segment read-only and
copies blocks straight from it into the caller's buffers (``get_shm`` in
kvstore/protocol.py); anything that does not work out (another host, another pid
namespace, no permission, a different file) leaves it on the UCX path.

``ClientOptions(shm=False)`` (kvstore/config.py; ``TANDEM_KV_SHM=0`` at the entry
points) turns the shared-memory read path off in a client; ``tandem kvstore --no-shm``
keeps a node's pool in private memory. The reads themselves: kvstore/shm_read.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
from functools import cache

import numpy as np

logger = logging.getLogger("tandem.kvstore.shm")

@cache
def host_id() -> str:
    """This host as seen by this process: hostname, boot id and pid namespace.

    Two processes with equal ids can open each other's ``/proc/<pid>/fd`` paths
    (same kernel, same pid namespace); a container on the same machine with a
    pid namespace of its own gets another id.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("?")
    return "/".join(parts)


def segment_gone(path: str, ident: str) -> bool:
    """Whether the node that advertised its segment as ``path`` (``/proc/<pid>/fd/<fd>``)
    and ``ident`` (:attr:`Segment.ident`) has exited: the path no longer leads to that
    file (the process is gone, or its pid now names another process).

    Meaningful only for a node of this :func:`host_id` (same kernel, same pid namespace).
    One ``stat``; ``False`` when it cannot tell (e.g. no permission, malformed ``ident``).
    """
    try:
        dev, ino = (int(x) for x in ident.split(":")[:2])
        st = os.stat(path)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) != (dev, ino)


class Segment:
    """The node's pool memory: an anonymous shared-memory file mapped read-write.

    Raises:
        OSError: ``memfd_create`` unavailable or the memory cannot be reserved.
    """

    def __init__(self, name: str, nbytes: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise OSError("memfd_create is not available on this platform")
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"tandem-kv-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mmap = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        st = os.fstat(self.fd)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.ident = f"{st.st_dev}:{st.st_ino}:{nbytes}"
        #: the pool's buffer (writable uint8 view of the whole segment)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        """Close the file (the mapping stays while :attr:`array` is referenced)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Mapping:
    """A client's read-only mapping of a node's segment.

    Raises:
        OSError: the path cannot be opened or is not the advertised segment.
    """

    def __init__(self, path: str, ident: str) -> None:
        dev, ino, nbytes = (int(x) for x in ident.split(":"))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < nbytes:
                raise OSError(f"{path} is not the advertised segment {ident}")
            # NOTE: pages are mapped on first touch (the kernel maps 16 at a time);
            # MAP_POPULATE made no measurable difference to gets and would stall the
            # first get on a large pool
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self.ident = ident
        self.nbytes = nbytes
        #: read-only uint8 view of the whole segment
        self.array = np.frombuffer(mm, dtype=np.uint8)
