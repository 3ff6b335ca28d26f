"""The exceptions of actorpipe's Python module."""


class PipelineError(RuntimeError):
    """A step or request that failed at run time, with the engine's fields.

    kind: "timeout", "shape_mismatch", "stage_failure", "stage_lost", "node_lost",
    "replica_failure", "io", "out_of_memory", "disk_full" or "other". stage, microbatch, step
    and node are None where the failure does not concern them. failures: when several stages
    failed (a save, a load), each one's PipelineError with its own fields; empty otherwise. A
    failed step changed no parameter.
    """

    def __init__(self, message, kind="other", stage=None, microbatch=None, step=None, node=None):
        super().__init__(message)
        self.kind = kind
        self.stage = stage
        self.microbatch = microbatch
        self.step = step
        self.node = node
        self.failures = []
