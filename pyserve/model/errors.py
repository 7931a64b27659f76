class ModelLoadError(Exception):
    """The model cannot be used as given; the message says what to change."""
