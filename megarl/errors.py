"""User mistakes, as opposed to bugs: entry scripts print these as one line and exit 2."""


class UserInputError(ValueError):
    """Bad input from the user (config, data file, checkpoint directory); ``kind`` names it."""

    kind = "input error"


class DataError(UserInputError):
    """A prompt or SFT data file that cannot be read as asked; the message names file and line."""

    kind = "data error"
