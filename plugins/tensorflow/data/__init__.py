"""Horovod's tf.data service support: data pipelines run on separate compute ranks (see compute_service)."""
