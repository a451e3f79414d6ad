"""The compute service (commsched/compute_service.py) in one process, and Horovod's tf.data service
support end to end: a 2-rank compute job (`python -m commsched.tensorflow.data.compute_worker`)
under mpiexec serving a training process that reads every element exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mpirun import mpiexec

from commsched.compute_service import ComputeClient, ComputeService, make_secret_key


@pytest.fixture
def service() -> ComputeService:
    started = ComputeService(2, 2, key=make_secret_key())
    yield started
    started.shutdown()


def test_dispatchers_and_workers_meet_through_the_service(service: ComputeService) -> None:
    """Registrations reach waiting clients; every wait returns once what it waits for is there."""
    client = ComputeClient(service.addresses(), service._key)
    found: list[str] = []
    waiter = threading.Thread(target=lambda: found.append(client.wait_for_dispatcher_registration(1, 10)))
    waiter.start()
    time.sleep(0.2)
    client.register_dispatcher(1, "grpc://localhost:5050")
    waiter.join(5)
    assert found == ["grpc://localhost:5050"]
    client.register_dispatcher(1, "grpc://localhost:5050")  # the same address again is fine
    client.register_worker_for_dispatcher(1, 0)
    with pytest.raises(TimeoutError, match="workers for dispatcher 1 to register"):
        client.wait_for_dispatcher_worker_registration(1, 0.3)
    client.register_worker_for_dispatcher(1, 1)
    client.wait_for_dispatcher_worker_registration(1, 1)
    ended = threading.Thread(target=client.wait_for_shutdown)
    ended.start()
    time.sleep(0.2)
    assert ended.is_alive()
    ComputeClient(service.addresses(), service._key).shutdown()
    ended.join(3)
    assert not ended.is_alive()


def test_bad_requests_are_refused_by_name(service: ComputeService) -> None:
    """Unknown dispatchers, a second address, a missing dispatcher and another key each get a clear error."""
    client = ComputeClient(service.addresses(), service._key)
    with pytest.raises(IndexError, match=r"within \[0..1\]: 2"):
        client.register_dispatcher(2, "grpc://x:1")
    client.register_dispatcher(0, "grpc://x:1")
    with pytest.raises(
        ValueError, match="already been registered under different address grpc://x:1: grpc://y:2"
    ):
        client.register_dispatcher(0, "grpc://y:2")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="dispatcher 1 to register"):
        client.wait_for_dispatcher_registration(1, 0.5)
    assert time.monotonic() - started < 3
    stranger = ComputeClient(service.addresses(), b"another key")
    with pytest.raises(ConnectionError, match="another key"):
        stranger.register_dispatcher(1, "grpc://z:3")
    with pytest.raises(ValueError, match="larger than 0"):
        ComputeService(0, 1, key=b"k")


def test_a_client_of_a_stopped_service_is_told_not_left_waiting() -> None:
    """After the service stops, calls raise ConnectionError at once and wait_for_shutdown returns."""
    stopped = ComputeService(1, 1, key=make_secret_key())
    client = ComputeClient(stopped.addresses(), stopped._key)
    stopped.shutdown()
    with pytest.raises(ConnectionError, match="not reachable"):
        client.register_dispatcher(0, "grpc://x:1")
    client.wait_for_shutdown()


TRAINING = textwrap.dedent(
    """
    import sys
    import tensorflow as tf
    from commsched.tensorflow.data.compute_service import TfDataServiceConfig

    config = TfDataServiceConfig.read(sys.argv[1], wait_for_file_creation=True, timeout=120)
    try:
        dataset = tf.data.Dataset.range(1024).batch(128).send_to_data_service(config, 0, 1)
        seen = sorted(int(v) for batch in dataset.as_numpy_iterator() for v in batch)
        print("ELEMENTS", len(seen), seen == list(range(1024)), flush=True)
    finally:
        config.compute_client().shutdown()
    """
)


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
def test_training_reads_its_pipeline_from_a_compute_job(tmp_path: Path) -> None:
    """Two compute ranks serve a distributed epoch: the training process gets each of 1024 elements once."""
    pytest.importorskip("tensorflow")
    config = tmp_path / "compute.json"
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    compute = subprocess.Popen(
        [
            str(mpiexec()),
            "-n",
            "2",
            sys.executable,
            "-m",
            "commsched.tensorflow.data.compute_worker",
            str(config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
    )
    try:
        training = subprocess.run(
            [sys.executable, "-c", TRAINING, str(config)],
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
            env=environment,
        )
        compute_output, _ = compute.communicate(timeout=60)
    finally:
        compute.kill()
    assert "ELEMENTS 1024 True" in training.stdout, training.stdout[-3000:] + training.stderr[-3000:]
    assert compute.returncode == 0, compute_output[-3000:]
