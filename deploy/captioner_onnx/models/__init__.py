"""The host's part of the searches (`search_host`, the full package's `captioner.models.search_host`)."""
