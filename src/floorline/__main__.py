from floorline.cli import main

main()
