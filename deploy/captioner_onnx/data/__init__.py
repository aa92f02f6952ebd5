"""Image reading: the full package's `captioner.data.images`."""
