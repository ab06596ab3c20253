"""The batch store alone (no server): a line is counted once however often it is finished, a batch's
end can be repeated after a crash without new files, what a crash leaves pending is what runs again,
and files and batches are per owner, paged newest first."""

from __future__ import annotations

from pathlib import Path

from tokenmill.entrypoints.openai.batch_store import BatchStore, LineResult


def make_batch(store: BatchStore, owner: str = "o") -> str:
    f = store.add_file(owner, "in.jsonl", "batch", b'{"custom_id": "a"}\n')
    batch = store.add_batch(owner, {"endpoint": "/v1/completions", "input_file_id": f["id"], "created_at": 0,
                                    "expires_at": 10**10, "completion_window": "24h", "metadata": None})
    lines = [(f"c{i}", '{"url": "/v1/completions", "body": {}}', None) for i in range(4)]
    store.add_lines(batch["id"], [*lines, (None, None, {"id": "x", "custom_id": None, "response": None,
                                                        "error": {"code": "invalid_json", "message": "m"}})])
    return str(batch["id"])


def test_lines_count_once_and_a_reopened_store_resumes_the_pending_ones(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch_id = make_batch(store)
    record = {"id": "r", "custom_id": "c0", "response": {"status_code": 200, "body": {}}, "error": None}
    assert store.finish_line(batch_id, LineResult(0, record, True))
    assert not store.finish_line(batch_id, LineResult(0, record, True))  # done already: nothing changes
    assert store.finish_line(batch_id, LineResult(1, {**record, "custom_id": "c1"}, False))
    store.add_lines(batch_id, [])  # validated again after a crash: the lines stay as they are
    store.close()
    store = BatchStore(tmp_path)  # as after kill -9
    assert [p.custom_id for p in store.pending_lines(batch_id)] == ["c2", "c3"]
    counts = store.get_batch(batch_id)["request_counts"]  # type: ignore[index]
    assert counts == {"total": 5, "completed": 1, "failed": 2}  # the malformed line failed at once


def test_ending_a_batch_twice_writes_the_same_files(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch_id = make_batch(store)
    store.finish_line(batch_id, LineResult(0, {"custom_id": "c0"}, True))
    first = store.finish_batch(batch_id, "expired", {"code": "batch_expired", "message": "m"})
    files_before = store.list_files("o", None, None, 100, True)[0]
    again = store.finish_batch(batch_id, "expired", {"code": "batch_expired", "message": "m"})
    assert (first["output_file_id"], first["error_file_id"]) == (again["output_file_id"], again["error_file_id"])
    assert len(store.list_files("o", None, None, 100, True)[0]) == len(files_before) == 3
    errors = store.path_of(first["error_file_id"]).read_text().splitlines()
    assert len(errors) == 4  # the malformed line and the three never run
    assert first["status"] == "expired" and first["expired_at"]


def test_owners_and_pages(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    mine = [make_batch(store, "me") for _ in range(3)]
    theirs = make_batch(store, "them")
    page, more = store.list_batches("me", None, 2)
    assert [b["id"] for b in page] == mine[:0:-1] and more
    page, more = store.list_batches("me", page[-1]["id"], 2)
    assert [b["id"] for b in page] == [mine[0]] and not more
    assert store.get_batch(theirs, "me") is None and store.get_batch(theirs, "them") is not None
    assert all(f["id"] != theirs for f in store.list_files("me", "batch", None, 100, False)[0])
    f = store.list_files("them", None, None, 1, True)[0][0]
    assert not store.delete_file("me", f["id"]) and store.delete_file("them", f["id"])
    assert not store.path_of(f["id"]).exists()
