"""plait: collective communication for Python."""
