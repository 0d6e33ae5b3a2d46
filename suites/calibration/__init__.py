"""Calibration of a backend policy (``kvparity calibrate``): how far batched
logits move from solo ones on this device, and the ``kl`` tier that data
can honestly support. ``run.calibrate`` runs the phases and writes the
JSON file; ``survey``, ``sweep`` and ``drift`` measure, ``proposal``
proposes."""
