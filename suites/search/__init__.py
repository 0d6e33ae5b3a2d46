"""The generated search and what it reaches: ``fuzz`` (Hypothesis's state
machine over the protocol), ``campaign`` (workers, a shared example
database, the gate's fixed budget), ``arrivals_strategy`` (generated L3
files), ``shrink`` (a failing schedule made minimal, and the member it
names), ``coverage`` (the coverage model: paths at settings, value cells),
``selection`` (which catalog files a run takes)."""
