"""Training: parallel setup, schedules, optimizer, checkpoints and the loop."""

from bebop_megatron.training.trainer import StepMetrics, Trainer

__all__ = ["StepMetrics", "Trainer"]
