"""Datasets, their vocabulary and feature cache; the datamodules (which import Lightning) are in `datamodules`."""
