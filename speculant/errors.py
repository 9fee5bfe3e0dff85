"""User-facing errors: one precise message, no traceback."""


class SpeculantError(Exception):
    """An error caused by the user's input (path, config, parameter); its message is shown as is."""
