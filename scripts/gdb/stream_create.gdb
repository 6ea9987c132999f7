set pagination off
set confirm off
set breakpoint pending on
set print thread-events off
set print inferior-events off
break cuStreamCreate
commands
silent
printf "=== cuStreamCreate\n"
bt 30
continue
end
break cuStreamCreateWithPriority
commands
silent
printf "=== cuStreamCreateWithPriority\n"
bt 30
continue
end
run
quit
