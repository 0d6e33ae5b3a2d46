"""The commands of ``kvparity``, one module each (its name, help, arguments
and handler); ``parser`` assembles them, ``base`` holds what they share."""
