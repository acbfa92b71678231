"""Calibration samples (streamed, routed into buckets) and the rules applied to their ranges."""
