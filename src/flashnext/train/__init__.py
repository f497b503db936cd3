"""Training: losses (`loss.py`); the trainer's other parts live beside them."""
