"""The detectors: the one error rule, frequency buckets, distances between arms, the verdict, the lockstep check
and the preflight probe. Everything that decides whether a kernel is wrong lives here and imports `rule`."""
