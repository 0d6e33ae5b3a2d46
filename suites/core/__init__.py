"""The one replay core every level shares: ``replay`` walks a schedule's
events against a batch and the rows alone, ``adapter`` loads and guards the
implementation under test, ``compare`` says where two tensors differ,
``evidence`` holds each row's verdict, ``flight`` records the member call in
flight (a crash or a hang names it), ``processes`` starts and stops the
processes kvparity runs, ``process_cache`` and ``process_frame`` reach a
cache in another process (``--impl exec:``), ``metrics`` measures logits.
Imports the format (``format``) and the oracle."""
