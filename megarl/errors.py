"""User mistakes, as opposed to bugs: entry scripts print these as one line and exit 2."""


class UserInputError(ValueError):
    """Bad input from the user (config, data file, checkpoint directory); ``kind`` names it."""

    kind = "input error"


class ConfigError(UserInputError):
    """A user mistake in the config; printed as one line, exit code 2."""

    kind = "config error"


class DataError(UserInputError):
    """A prompt or SFT data file that cannot be read as asked; the message names file and line."""

    kind = "data error"


class NonFiniteError(UserInputError):
    """NaN / inf where training or an export cannot go on (usually a learning rate or loss
    scale too high); the message names the step or tensor. Printed as one line, exit 2."""

    kind = "non-finite values"


class CheckpointError(UserInputError):
    """A training checkpoint that cannot be resumed (damaged, another model's, another layout);
    the message names the directory and what to do."""

    kind = "checkpoint error"


class ExtensionError(UserInputError):
    """A user extension point (``module:function``) returned something unusable: the
    message names the config key, what came back and what is expected."""

    kind = "extension error"
