"""The exit codes of the ``normscope`` command line, in one place (a leaf module: every subcommand imports it).

Also printed by ``normscope --help`` (``EXIT_CODES``), and listed in the README and docs/usage.md.
"""

from __future__ import annotations

EXIT_OK = 0  # success (check: every finding passed)
EXIT_FAIL = 1  # a check failed: a check finding, a contract mismatch, a scan/diagnose --strict finding
EXIT_USAGE = 2  # usage or input error: one line on stderr names the problem and the fix
EXIT_NOT_NORM = 3  # infer: the target is not a normalization
EXIT_TIMEOUT = 4  # the target hung: one call ran longer than --timeout
EXIT_DIVERGED = 5  # diff: the candidate diverged
EXIT_INCONCLUSIVE = 6  # diff, check, contract, scan/diagnose --strict: could not tell (a site not compared, nothing tested)
EXIT_CRASH = 70  # an internal error (a bug; the traceback is printed): never a verdict (sysexits' EX_SOFTWARE)
EXIT_INTERRUPTED = 130  # Ctrl-C
EXIT_BROKEN_PIPE = 141  # the output pipe was closed early

EXIT_CODES = """exit codes:
  0    success (check: every finding passed)
  1    a check failed: a check finding, a contract mismatch between two
       artifacts, a finding of scan --strict or diagnose --strict (never used
       for anything else)
  2    usage or input error: one line on stderr names the problem and the fix
  3    infer: the target is not a normalization
  4    the target hung: one call ran longer than --timeout
  5    diff: the candidate diverged (a site's own error exceeds its bound, or
       the candidate raised or changed a shape)
  6    inconclusive: diff, check or contract could not look or could not
       tell (diff: sites left uncompared, a comparison that raised, the
       reference not finite; check: a finding that decides the contract could
       not separate it from another, or every finding a skip: nothing tested;
       contract: no mismatch, but a site unverified or nothing compared;
       scan --strict: no finding, but sites not judged, e.g. a non-finite
       model input; diagnose --strict: no incident, but too few recorded
       steps, a failed probe or damaged lines); the reason and what would
       decide it are printed; never a pass
  70   internal error: a bug in normscope (the traceback is printed); never a
       verdict on what was checked
  130  interrupted (Ctrl-C)
  141  the output pipe was closed early (e.g. normscope ... --json | head)"""
