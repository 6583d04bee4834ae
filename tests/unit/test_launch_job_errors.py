"""``plait.launch.Job`` refuses a command given as one string: it was split into characters,
one argument each (``Job('hello.py')`` ran ``h e l l o . p y``)."""

from __future__ import annotations

import pytest

from plait.launch import Job


@pytest.mark.parametrize("command", ["hello.py", "python hello.py", b"hello.py", bytearray(b"x")])
def test_a_command_in_one_string_is_refused(command: object) -> None:
    with pytest.raises(TypeError, match=r"a list of the program and its arguments, such as "
                       r"\['python', 'hello\.py'\], not one string"):  # fmt: skip
        Job(command)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [["python", "hello.py"], ("true",)])
def test_a_list_or_tuple_of_arguments_is_taken(command: list[str] | tuple[str, ...]) -> None:
    assert list(Job(command).command) == list(command)
