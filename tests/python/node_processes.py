"""`actorpipe node` processes for the tests that place stages on nodes."""
import contextlib
import os
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nodes(count):
    """Starts `count` nodes of $ACTORPIPE_CLI on free local ports; yields their "host:port"s and
    kills them on the way out."""
    started = []
    try:
        for _ in range(count):
            port = free_port()
            node = subprocess.Popen([os.environ["ACTORPIPE_CLI"], "node", "--listen",
                                     f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            started.append((node, port))
            deadline = time.time() + 20
            for line in node.stdout:
                if "listening on" in line or time.time() > deadline:
                    break
        yield [f"127.0.0.1:{port}" for _, port in started]
    finally:
        for node, _ in started:
            node.kill()
            node.wait()
            node.stdout.close()
