"""Helpers shared by the test suite: problems, cases, oracles of small models, rank launchers and
the worker scripts that ranks run. Tests import these (``from parity_tests.support import ...``);
no test imports another test module, and nothing here is collected as a test."""
