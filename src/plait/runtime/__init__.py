"""Running schedules: the executor and the Work handle."""
