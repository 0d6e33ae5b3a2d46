"""The test-case format: what a schedule file may say and the words it says
it in. ``schedule`` (a file's fields, its models and settings), ``events``
(each event kind and what it checks of its fields), ``arrivals`` (L3 and L4
files of requests arriving over time), ``levels`` and ``checks`` (the
levels and checks, each declared once), ``stored`` (a stored prefix's
entry). Any runner reads these; a file is checked whole before anything
runs. Imports nothing else of suites/ but the replay core's dry run, which
is how a schedule proves it can happen (``core``)."""
