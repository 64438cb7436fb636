"""The in-job side: a model server that survives preemption and requeue."""
