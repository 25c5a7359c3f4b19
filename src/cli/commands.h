// Entry points of the deltamoe subcommands; each lives in its own cmd_<name>.cc.
// A command returns the process exit code; errors are thrown as deltamoe::Error.
#pragma once

namespace deltamoe {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);  // argv[1] is the command name
};

int cmd_version(int argc, char** argv);
int cmd_tokenize(int argc, char** argv);
int cmd_image(int argc, char** argv);
int cmd_init(int argc, char** argv);
int cmd_inspect(int argc, char** argv);
int cmd_convert(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_parity(int argc, char** argv);
int cmd_train(int argc, char** argv);
int cmd_data(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_launch(int argc, char** argv);
int cmd_comm_selftest(int argc, char** argv);
int cmd_plan(int argc, char** argv);

// NPROC_PER_NODE=N deltamoe <command>: whether this invocation should re-run itself through the
// launcher (set, not already a launched rank, and the command runs distributed), and doing so.
bool wants_launch_from_env(int argc, char** argv);
int launch_from_env(int argc, char** argv);

}  // namespace deltamoe
