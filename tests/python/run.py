"""Runs one unittest class as a CTest test: exit 0 when its tests passed, 77 (CTest: skipped)
when every one of them was skipped (no GPU, no Gloo in this libtorch), 1 otherwise.

    python3 run.py test_api.StepsTest
"""
import sys
import unittest

if __name__ == "__main__":
    suite = unittest.defaultTestLoader.loadTestsFromName(sys.argv[1])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    if not result.wasSuccessful():
        sys.exit(1)
    if result.testsRun and len(result.skipped) == result.testsRun:
        print(f"skipped: {result.skipped[0][1]}")
        sys.exit(77)
