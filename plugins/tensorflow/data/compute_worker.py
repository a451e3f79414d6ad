"""The compute job of commsched.tensorflow.data: `python -m commsched.tensorflow.data.compute_worker CONFIG`.

Rank 0 starts the compute service and writes its config to CONFIG for the training job; every
rank then runs a tf.data service worker (and, with `--dispatcher-side compute`, one dispatcher
per `size / dispatchers` ranks) until a training rank calls `config.compute_client().shutdown()`.
"""

from __future__ import annotations

import argparse

import commsched.tensorflow as hvd
from commsched.tensorflow.data.compute_service import TfDataServiceConfig, compute_worker_fn

import tensorflow as tf
from commsched.compute_service import ComputeService, make_secret_key


def main(dispatchers: int, dispatcher_side: str, configfile: str, timeout: int) -> None:
    """Runs this rank of the compute job until the service is shut down."""
    if dispatcher_side not in ("compute", "training"):
        raise ValueError(f"--dispatcher-side is 'compute' or 'training', not {dispatcher_side!r}")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if dispatchers < 1 or size % dispatchers:
        raise ValueError(
            f"Number of processes ({size}) must be a multiple of number of dispatchers ({dispatchers})."
        )
    service = None
    try:
        config = None
        if rank == 0:
            key = make_secret_key()
            service = ComputeService(dispatchers, size // dispatchers, key=key)
            config = TfDataServiceConfig(
                dispatchers=dispatchers,
                workers_per_dispatcher=size // dispatchers,
                dispatcher_side=dispatcher_side,
                addresses=service.addresses(),
                key=key,
                timeout=timeout,
            )
            config.write(configfile)
        with tf.device("/cpu:0"):
            config = hvd.broadcast_object(config, name="TfDataServiceConfig")
        compute_worker_fn(config)
    finally:
        if service is not None:
            service.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "configfile", help="where rank 0 writes the compute service config for the training job"
    )
    parser.add_argument("--dispatchers", type=int, default=1, help="the number of tf.data dispatchers")
    parser.add_argument(
        "--dispatcher-side", default="compute", dest="dispatcher_side", help="'compute' or 'training'"
    )
    parser.add_argument("--timeout", type=int, default=60, help="seconds to wait for dispatchers and workers")
    arguments = parser.parse_args()
    main(arguments.dispatchers, arguments.dispatcher_side, arguments.configfile, arguments.timeout)
