"""The detectors: frequency buckets, distances between arms, the verdict, the lockstep check and the preflight
probe. Everything that decides whether a kernel is wrong lives here and imports the one error rule,
`divergence/rule.py` (at the bottom layer: slot adapters judge a problem's extra outputs by it too)."""
