"""Training ranks reading their tf.data pipeline from TensorFlow data-service workers on compute ranks.

As Horovod's horovod.tensorflow.data: a job of compute ranks (`python -m
commsched.tensorflow.data.compute_worker CONFIG`, under any launcher) starts a ComputeService on
its rank 0, writes a TfDataServiceConfig to CONFIG and runs a tf.data service worker per rank
(and the dispatchers, with `--dispatcher-side compute`). Training ranks read CONFIG and either
call `dataset.send_to_data_service(config, rank, size)` or, with dispatchers on the training side,
use `with tf_data_service(config, rank) as address:` and `tf.data.experimental.service.distribute`.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import commsched.tensorflow as hvd

import tensorflow as tf
from commsched.compute_service import ComputeClient

log = logging.getLogger("commsched")


@dataclasses.dataclass(frozen=True)
class TfDataServiceConfig:
    """Where the compute service is, with its key, and how dispatchers and workers are laid out."""

    dispatchers: int
    workers_per_dispatcher: int
    dispatcher_side: str
    addresses: Mapping[str, Sequence[tuple[str, int]]]
    key: bytes
    timeout: int = 60

    def compute_client(self, verbose: int = 1) -> ComputeClient:
        """A client of the compute service this config names."""
        return ComputeClient(self.addresses, self.key, verbose=verbose)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values (the key in hex)."""
        values = dataclasses.asdict(self)
        values["key"] = binascii.hexlify(self.key).decode()
        values["addresses"] = {name: [list(pair) for pair in pairs] for name, pairs in self.addresses.items()}
        return values

    @staticmethod
    def from_dict(config: Mapping[str, Any]) -> TfDataServiceConfig:
        """The config to_dict() wrote."""
        return TfDataServiceConfig(
            dispatchers=int(config["dispatchers"]),
            workers_per_dispatcher=int(config["workers_per_dispatcher"]),
            dispatcher_side=str(config["dispatcher_side"]),
            addresses={
                name: [(str(h), int(p)) for h, p in pairs] for name, pairs in config["addresses"].items()
            },
            key=binascii.unhexlify(config["key"]),
            timeout=int(config.get("timeout", 60)),
        )

    def write(self, filename: str) -> None:
        """Writes the config to `filename` at once (a reader never sees half of it)."""
        path = Path(filename)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as partial:
            partial.write(json.dumps(self.to_dict()))
        os.replace(partial.name, path)

    @staticmethod
    def read(
        filename: str, wait_for_file_creation: bool = False, timeout: float = 600.0
    ) -> TfDataServiceConfig:
        """Reads a written config; with `wait_for_file_creation`, waits up to `timeout` seconds for the file."""
        deadline = time.monotonic() + timeout
        while wait_for_file_creation and not os.path.exists(filename):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no compute service config appeared at {filename} within {timeout} s; start the compute "
                    "job (python -m commsched.tensorflow.data.compute_worker CONFIG) with that path"
                )
            time.sleep(0.1)
        with open(filename) as file:
            return TfDataServiceConfig.from_dict(json.load(file))


@contextmanager
def tf_data_service(compute_config: TfDataServiceConfig, rank: int) -> Iterator[str]:
    """Yields the address of the dispatcher this training rank uses, once its workers are ready.

    With dispatchers on the training side, rank 0 (one dispatcher) or every rank starts one here
    and stops it on exit.
    """
    compute = compute_config.compute_client(verbose=2)
    dispatcher = None
    several = compute_config.dispatchers > 1
    if compute_config.dispatcher_side == "training" and (several or rank == 0):
        dispatcher = tf.data.experimental.service.DispatchServer()
        compute.register_dispatcher(rank if several else 0, dispatcher.target)
        log.info("tf.data dispatcher %s serves at %s", rank if several else 0, dispatcher.target)
    index = rank if several else 0
    address = compute.wait_for_dispatcher_registration(index, compute_config.timeout)
    compute.wait_for_dispatcher_worker_registration(index, compute_config.timeout)
    try:
        yield address
    finally:
        if dispatcher is not None:
            dispatcher._stop()  # TensorFlow has no public way to stop a dispatcher
            dispatcher.join()


def send_to_data_service(
    dataset: tf.data.Dataset,
    compute_config: TfDataServiceConfig,
    rank: int,
    size: int | None = None,
    processing_mode: str = "distributed_epoch",
    reuse_dataset: bool = False,
    round_robin: bool = False,
) -> tf.data.Dataset:
    """`dataset` processed by the compute ranks' tf.data service workers (dispatchers on the compute side)."""
    if compute_config.dispatcher_side == "training":
        raise RuntimeError(
            "send_to_data_service needs dispatchers on the compute side; with --dispatcher-side training use "
            "`with tf_data_service(config, rank) as address:` and tf.data.experimental.service.distribute"
        )
    with tf_data_service(compute_config, rank) as address:
        return dataset.apply(
            tf.data.experimental.service.distribute(
                processing_mode=processing_mode,
                service=address,
                job_name="job" if reuse_dataset else None,
                consumer_index=rank if reuse_dataset and round_robin else None,
                num_consumers=size if reuse_dataset and round_robin else None,
            )
        )


tf.data.Dataset.send_to_data_service = send_to_data_service  # as Horovod: dataset.send_to_data_service(...)


def compute_worker_fn(compute_config: TfDataServiceConfig) -> None:
    """Runs this compute rank's tf.data worker (and dispatcher, if it has one) until the service shuts down."""
    hvd.init()
    index = hvd.rank()
    dispatcher_index = index // compute_config.workers_per_dispatcher
    compute = compute_config.compute_client(verbose=2)
    dispatcher = None
    if compute_config.dispatcher_side == "compute" and index % compute_config.workers_per_dispatcher == 0:
        dispatcher = tf.data.experimental.service.DispatchServer()
        compute.register_dispatcher(dispatcher_index, dispatcher.target)
    address = compute.wait_for_dispatcher_registration(dispatcher_index, compute_config.timeout)
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(
            dispatcher_address=address.split("://")[1],
            heartbeat_interval_ms=1000,
            dispatcher_timeout_ms=compute_config.timeout * 1000,
        )
    )
    worker.start()
    compute.register_worker_for_dispatcher(dispatcher_index, index)
    compute.wait_for_shutdown()
    worker._stop()  # TensorFlow has no public way to stop a worker or dispatcher
    worker.join()
    if dispatcher is not None:
        dispatcher._stop()
        dispatcher.join()
