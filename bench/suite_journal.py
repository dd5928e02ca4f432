"""A pytest plugin that appends each test's start and outcome to a journal the moment they
happen (bench/suite_stages.py loads it with `-p suite_journal` and reads the journal back).

The journal, FLOORLINE_TEST_JOURNAL, is written by the process that reports the tests: pytest
itself, or pytest-xdist's controller, which receives every worker's reports (a worker crashed
mid-test included), so a run cut off at any point still tells which tests failed and which had
started and not finished. One JSON object a line: event, nodeid and t. The events: collected
(ids: every test to run, so that those never started can be named), start, report (when: the
phase; outcome; duration; detail: a failure's text), finish, and collect (a file that could not
be collected, with its detail).
"""

import json
import os
import time

import pytest

PATH = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("FLOORLINE_TEST_JOURNAL")
DETAIL_CHARS = 8000  # a failure's last characters: the stack's end and the assertion
collected = False


def write(event: str, nodeid: str, **fields) -> None:
    if PATH:
        with open(PATH, "a") as f:
            f.write(json.dumps({"event": event, "nodeid": nodeid, "t": time.time(), **fields})
                    + "\n")


def pytest_collection_finish(session):
    if session.items:  # pytest without xdist (xdist's controller collects none)
        write("collected", "", ids=[item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    global collected  # every worker collects the same ids: written once
    if not collected:
        collected = True
        write("collected", "", ids=list(ids))


def pytest_runtest_logstart(nodeid, location):
    write("start", nodeid)


def pytest_runtest_logreport(report):
    failed = report.outcome == "failed"
    write("report", report.nodeid, when=report.when, outcome=report.outcome,
          duration=round(report.duration, 3),
          detail=str(report.longrepr)[-DETAIL_CHARS:] if failed else None)


def pytest_runtest_logfinish(nodeid, location):
    write("finish", nodeid)


def pytest_collectreport(report):
    if report.failed:
        write("collect", report.nodeid or "(collection)",
              detail=str(report.longrepr)[-DETAIL_CHARS:])
