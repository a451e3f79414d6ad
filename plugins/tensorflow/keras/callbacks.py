"""``hvd.callbacks`` of ``commsched.tensorflow.keras``: Horovod's Keras callbacks."""

from __future__ import annotations

from commsched.tensorflow.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
